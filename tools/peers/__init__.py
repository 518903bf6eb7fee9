"""Other runtimes on the same model, timed by `trt-spec bench --peers` next to our methods.

Every peer has one shape:

    available() -> (ok, reason)       can it run here at all (imports, binaries)
    load(ctx: PeerContext) -> None    builds what it needs once (cached), loads the model
    holds_schemas() -> (ok, reason)   after load: can it hold its output to a JSON schema
    generate(prompt_ids, max_new_tokens, temperature, seed, json_schema=None) -> dict
    close() -> None

generate() takes the prompt token ids our tokenizer made (chat template applied), decodes
max_new_tokens tokens ignoring EOS (greedy at temperature 0) and returns bench's per-run
fields where they apply. Under a json_schema (a prompt line's "json_schema") the peer holds
its output to the schema with its own structured-output feature and stops where the JSON
ends (the grammar's end or EOS, as ours does), max_new_tokens being only a cap. The fields:

    tokens_per_s       decode: (completion_tokens - 1) / time after the first token
    completion_tokens  int
    target_forwards    int, or None where the peer does not say (tau is then None)
    ttft_s             prompt in -> first token out
    output_ids         list[int]
    acceptance_rate    optional: a speculating peer's own acceptance rate
    same_as_own_plain  optional (greedy): whether its output equals its own plain output
                       (under the same schema, where there is one)
    untimed_s          optional: seconds of the call spent on such checks, not decoding

Peers import their runtimes lazily: this package imports without torch, transformers,
onnxruntime-genai, llama.cpp or OpenVINO.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from trt_spec.runtime.files import cache_dir


@dataclass(frozen=True)
class PeerContext:
    """What a peer needs to run the engine's model, from the engine's manifest."""
    model: str  # manifest source.model: a known model name, a .gguf file or an HF folder
    draft: str | None  # the engine's vanilla draft checkpoint (project format), if any
    threads: int
    num_draft_tokens: int  # k, for the assisted peer
    cache: Path  # derived weights (HF draft, ORT-genai model) are built here once


class Peer(Protocol):
    name: str
    engine: str  # the peer's model / weights, in words (set by load)
    precision: str
    num_draft_tokens: int | None  # k where the peer speculates, else None

    def available(self) -> tuple[bool, str]: ...

    def load(self, ctx: PeerContext) -> None: ...

    def holds_schemas(self) -> tuple[bool, str]: ...

    def generate(self, prompt_ids: list[int], max_new_tokens: int, temperature: float,
                 seed: int, json_schema: dict | None = None) -> dict: ...

    def close(self) -> None: ...


def parse_peers(text: str) -> list[str]:
    """'a,b' -> ['a', 'b'], each a known peer."""
    names = list(dict.fromkeys(n.strip() for n in text.split(",") if n.strip()))
    for n in names:
        if n not in PEERS:
            raise ValueError(f"--peers: {n!r} is not a peer; choose from {', '.join(PEERS)}")
    return names


def peer_threads(threads: int | None) -> int:
    """bench's --threads, else what our ORT sessions take ($TRT_SPEC_THREADS, every core)."""
    from trt_spec.runtime.backends.ort import default_threads

    return threads or default_threads()


def peer_context(manifest_data: dict, threads: int | None, num_draft_tokens: int,
                 folder: str | Path | None = None) -> PeerContext:
    """The engine's source model and draft, and a cache folder for what peers derive.
    `folder`: the engine folder, which the manifest's local paths are relative to."""
    import hashlib

    from trt_spec.runtime.manifest import source_path

    source = manifest_data.get("source", {})
    resolve = (lambda v: v) if folder is None else (lambda v: source_path(folder, v))
    model = resolve(source.get("model"))
    if not model:
        raise ValueError("the engine's manifest.json records no source model: peers need it")
    root = cache_dir()
    if "/" in model or model.endswith(".gguf"):  # a path: a folder of its own under peers/
        key = hashlib.sha256(str(Path(model).resolve()).encode()).hexdigest()[:16]
        cache = root / "peers" / f"{Path(model).stem}-{key}"
    else:
        cache = root / model
    return PeerContext(model=model, draft=resolve(source.get("draft_model")) or None,
                       threads=peer_threads(threads), num_draft_tokens=num_draft_tokens,
                       cache=cache)


def peer_ks(cls, ks: list) -> list[int | None]:
    """The draft lengths a peer runs at: a peer that sweeps k (`SWEEPS_K`) runs once per
    integer k of --num-draft-tokens (its own adaptive k stands in for auto; k 4 if none is
    an integer), every other peer once at the context's k."""
    if not getattr(cls, "SWEEPS_K", False):
        return [None]
    return sorted({k for k in ks if isinstance(k, int)}) or [4]


def decode_rate(stamps: list[float]) -> float | None:
    """stamps[i]: when token i came out. (n - 1) / (last - first), as our engine's metrics."""
    if len(stamps) < 2 or stamps[-1] <= stamps[0]:
        return None
    return (len(stamps) - 1) / (stamps[-1] - stamps[0])


def chunk_stamps(chunks: list[tuple[float, int]]) -> list[float]:
    """(when, how many new tokens) per chunk a runtime hands back -> one stamp per token (the
    tokens of one chunk share its stamp, as speculated or grammar-forced tokens arrive)."""
    return [t for t, n in chunks for _ in range(n)]


def plain_key(prompt_ids: list[int], json_schema: dict | None) -> tuple:
    """What a speculating peer's own plain output is cached by: the prompt and the schema."""
    return tuple(prompt_ids), (json.dumps(json_schema, sort_keys=True)
                               if json_schema is not None else None)


def _registry() -> dict:
    from trt_spec.tools.peers.hf import AssistedPeer, TransformersPeer
    from trt_spec.tools.peers.llamacpp import LlamaCppDraftPeer, LlamaCppNgramPeer, LlamaCppPeer
    from trt_spec.tools.peers.ortgenai import OrtGenaiDraftPeer, OrtGenaiNgramPeer, OrtGenaiPeer
    from trt_spec.tools.peers.openvino import OpenVinoLookupPeer, OpenVinoPeer

    return {"transformers": TransformersPeer, "transformers-assisted": AssistedPeer,
            "onnxruntime-genai": OrtGenaiPeer, "onnxruntime-genai-ngram": OrtGenaiNgramPeer,
            "onnxruntime-genai-draft": OrtGenaiDraftPeer,
            "llama.cpp": LlamaCppPeer, "llama.cpp-draft": LlamaCppDraftPeer,
            "llama.cpp-ngram": LlamaCppNgramPeer,
            "openvino": OpenVinoPeer, "openvino-lookup": OpenVinoLookupPeer}


PEERS: dict[str, type] = _registry()  # name -> class; tests may register a fake
