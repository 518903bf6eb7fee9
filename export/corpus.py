"""`trt-spec corpus`: an engine folder's n-gram table of answers (runtime/corpus.py).

    sharegpt_answers(tokenizer, conversations)
        the assistant answers of the first `conversations` ShareGPT conversations of the
        training split (held-out conversations never: their prompts are what benchmarks ask),
        tokenized by the engine's tokenizer
    distilled_answers(folder, vocab_size)
        the token ids of self-distilled shards (train/data/<model>: the target's own answers
        to training prompts)
    add_corpus(folder, ...)
        builds the table, writes corpus.npz into the folder and records it in the manifest
        (files checksummed as the graphs are); a second run with the same settings does nothing

The suffix lookup of every engine that has a table drafts from it (suffix, hybrid, auto).
"""

from __future__ import annotations

import hashlib
import os
import tempfile
import time
from pathlib import Path

import numpy as np

from trt_spec.runtime.manifest import (EngineFolderError, Manifest, load_manifest, sha256,
                                       write_manifest)
from trt_spec.runtime.corpus import CorpusTable, build_table

CORPUS_FILE = "corpus.npz"
DEFAULTS = {"conversations": 3000, "max_n": 8, "min_total": 3, "min_prob": 0.2}


def sharegpt_answers(tokenizer, conversations: int, progress=print) -> list[list[int]]:
    """The assistant turns of the first `conversations` ShareGPT conversations outside the
    held-out split, as token ids (no special tokens)."""
    from trt_spec.export.sharegpt import fetch_sharegpt, read_conversations, split

    if conversations <= 0:
        return []
    source, _ = read_conversations(fetch_sharegpt(), limit=conversations)
    train, heldout = split(source)
    texts = [m["content"] for c in train for m in c.messages
             if m["role"] == "assistant" and m["content"].strip()]
    progress(f"corpus: {len(texts)} answers of {len(train)} ShareGPT conversations "
             f"({len(heldout)} held-out ones left out)")
    return tokenizer.encode_batch(texts, add_special_tokens=False)


def distilled_answers(folder: str | Path, vocab_size: int) -> list[list[int]]:
    """Every answer in the shards of a self-distilled data folder (train/distill_data.py;
    its held-out/ subfolder is not read)."""
    folder = Path(folder)
    shards = sorted(folder.glob("shard-*.npz"))
    if not shards:
        raise ValueError(f"--distilled {str(folder)!r}: no shard-*.npz files there")
    out = []
    for path in shards:
        with np.load(path) as z:
            offsets, tokens = z["offsets"], z["tokens"].astype(np.int64)
        if len(tokens) and int(tokens.max()) >= vocab_size:
            raise ValueError(f"{path}: token id {int(tokens.max())} is outside this engine's "
                             f"vocabulary ({vocab_size}): shards of another model")
        out += [tokens[a:b].tolist() for a, b in zip(offsets[:-1], offsets[1:])]
    return out


def checked_folder(folder: Path) -> Manifest:
    """The folder's manifest, every file but the corpus table checked against its sha256:
    the manifest is written again (with every file's checksum), so a corrupt graph must not
    be blessed; a corrupt table is what a rebuild or --remove mends."""
    manifest = load_manifest(folder, verify="none")
    for name, entry in manifest.data["files"].items():
        if name != CORPUS_FILE and sha256(folder / name) != entry["sha256"]:
            raise EngineFolderError(f"{folder / name}: checksum differs from the manifest: "
                                    "the folder is corrupt; export it again")
    return manifest


def add_corpus(folder: str | Path, conversations: int = DEFAULTS["conversations"],
               distilled: str | Path | None = None, max_n: int = DEFAULTS["max_n"],
               min_total: int = DEFAULTS["min_total"], min_prob: float = DEFAULTS["min_prob"],
               sequences: list[list[int]] | None = None, force: bool = False,
               progress=print) -> dict:
    """Builds the folder's corpus table -> its manifest entry. `sequences`: token ids to
    build from instead of ShareGPT and `distilled` (tests, other sources)."""
    from trt_spec.runtime.tokenizer import Tokenizer

    folder = Path(folder)
    manifest = checked_folder(folder)
    if not 1 <= max_n <= 16:
        raise ValueError(f"--max-n {max_n}: must be in 1..16")
    if min_total < 1:
        raise ValueError(f"--min-count {min_total}: must be >= 1")
    if not 0 <= min_prob <= 1:
        raise ValueError(f"--min-prob {min_prob}: must be in [0, 1]")
    t0 = time.time()
    digest = hashlib.sha256()
    if sequences is not None:  # what the table is built from, cheaply: the answers given,
        for seq in sequences:  # or the sources' names, sizes and the tokenizer
            digest.update(np.asarray(seq, dtype=np.int64).tobytes() + b"|")
    else:
        from trt_spec.export.sharegpt import SHAREGPT_REQUIREMENT

        digest.update(f"{SHAREGPT_REQUIREMENT} {conversations}".encode())
        digest.update(manifest.data["files"]["tokenizer.json"]["sha256"].encode()
                      if "tokenizer.json" in manifest.data["files"] else b"")
        for shard in sorted(Path(distilled).glob("shard-*.npz")) if distilled else []:
            digest.update(f"|{shard.name} {shard.stat().st_size}".encode())
    settings = {"conversations": 0 if sequences is not None else conversations,
                "distilled": None if distilled is None or sequences is not None
                else Path(distilled).name,
                "sources_sha256": digest.hexdigest(),
                "max_n": max_n, "min_total": min_total, "min_prob": min_prob}
    old = manifest.data.get("corpus")
    intact = ((folder / CORPUS_FILE).is_file() and CORPUS_FILE in manifest.data["files"]
              and sha256(folder / CORPUS_FILE) == manifest.data["files"][CORPUS_FILE]["sha256"])
    if not force and old and old.get("settings") == settings and intact:
        progress(f"{folder / CORPUS_FILE} is up to date (--force builds it again)")
        return old
    if sequences is None:
        sequences = sharegpt_answers(Tokenizer(folder), conversations, progress)
        if distilled is not None:
            own = distilled_answers(distilled, manifest.config.vocab_size)
            progress(f"corpus: {len(own)} self-distilled answers from {distilled}")
            sequences = sequences + own
    if not sequences:
        raise ValueError("corpus: no answers to build from (--conversations 0 and no "
                         "--distilled)")
    tokens = sum(len(s) for s in sequences)
    progress(f"corpus: indexing {tokens:,} tokens, n-grams of 1..{max_n}")
    table = CorpusTable(build_table(sequences, max_n, min_total, min_prob), max_n)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".corpus.", suffix=".npz")
    os.close(fd)
    try:
        table.save(tmp)
        os.chmod(tmp, 0o644)
        os.replace(tmp, folder / CORPUS_FILE)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    entry = {"file": CORPUS_FILE, "settings": settings, "answers": len(sequences),
             "tokens": tokens, "entries": len(table)}
    data = {k: v for k, v in manifest.data.items() if k not in ("files", "format_version")}
    data["corpus"] = entry
    data["extra_files"] = sorted(set(data.get("extra_files", [])) | {CORPUS_FILE})
    write_manifest(folder, data)
    progress(f"corpus: {len(table):,} n-grams -> {folder / CORPUS_FILE} "
             f"({(folder / CORPUS_FILE).stat().st_size / 1e6:.1f} MB) in {time.time() - t0:.0f} s")
    return entry


def remove_corpus(folder: str | Path) -> None:
    """The folder without its corpus table (its manifest entry and file)."""
    folder = Path(folder)
    manifest = checked_folder(folder)
    data = {k: v for k, v in manifest.data.items()
            if k not in ("files", "format_version", "corpus")}
    data["extra_files"] = [f for f in data.get("extra_files", []) if f != CORPUS_FILE]
    if not data["extra_files"]:
        del data["extra_files"]
    write_manifest(folder, data)
    (folder / CORPUS_FILE).unlink(missing_ok=True)
