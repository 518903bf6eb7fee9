"""Self-distillation features: the target run over tokenized conversations, cached on disk.

Per token p of every sequence (fp32 torch TargetModel; stored as):
    hidden       [N, H]    fp16   final-normed hidden state (what lm_head reads; MTP / Eagle)
    eagle3       [N, 3H]   fp16   inputs to the target's layers config.eagle3_layers
    topk_ids     [N, k]    int32  the target's k most likely next tokens after x_0..x_p
    topk_probs   [N, k]    fp16   their probabilities (full-vocabulary softmax, temperature 1)
    input_ids    [N]       int32
    loss_mask    [N]       bool   x_p is an assistant token
    offsets      [S + 1]   int64  sequence s is rows offsets[s] .. offsets[s+1]

Layout: `folder/manifest.json` + `folder/shard_00000/*.npy` ... A shard is a fixed run of
consecutive examples (about `shard_tokens` tokens); it is written under `shard_XXXXX.tmp` and
renamed when complete, and only then recorded in the manifest with its key (a hash of the
settings and of its examples' ids, tokens and masks). Re-running skips a recorded shard whose
key is unchanged and redoes any other (an interrupted one, or one whose examples changed), so
a run with a larger token budget extends the folder; shards past the new plan are removed.
The model and the settings that shape every row (top_k, feature layers) must match the
folder's. The manifest's `plan` hashes the shard keys (the trainer checks it on resume).
Before each shard the bytes it will take are added to what is on disk; past `max_disk_bytes`
extraction stops with DiskBudgetExceeded, the finished shards kept.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Iterator

import numpy as np
import torch

from trt_spec.export.model import TargetModel, empty_cache
from trt_spec.train.configs import FeatureConfig
from trt_spec.train.data import Example

FORMAT = "trt-spec-features"
VERSION = 1
ARRAYS = ("input_ids", "loss_mask", "offsets", "hidden", "eagle3", "topk_ids", "topk_probs")
FP16_MAX = float(np.finfo(np.float16).max)


class DiskBudgetExceeded(RuntimeError):
    pass


@dataclass(frozen=True)
class Progress:
    shard: int  # shards finished so far (this run and earlier ones)
    shards: int
    tokens_done: int  # tokens extracted by this run
    tokens_todo: int  # tokens this run has to extract in all
    tokens_per_s: float
    eta_s: float


@dataclass(frozen=True)
class ExtractReport:
    shards: int
    skipped_shards: int  # already on disk
    tokens: int  # extracted by this run
    seconds: float
    bytes_on_disk: int

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


def plan_shards(examples: list[Example], shard_tokens: int) -> list[list[int]]:
    """Consecutive example indices, a new shard once one reaches `shard_tokens` tokens."""
    shards, current, size = [], [], 0
    for i, ex in enumerate(examples):
        current.append(i)
        size += len(ex.input_ids)
        if size >= shard_tokens:
            shards.append(current)
            current, size = [], 0
    if current:
        shards.append(current)
    return shards


def shard_bytes(tokens: int, hidden: int, top_k: int, sequences: int) -> int:
    """Bytes a shard of `tokens` tokens takes (the .npy headers aside)."""
    per_token = 2 * hidden + 2 * 3 * hidden + (4 + 2) * top_k + 4 + 1
    return tokens * per_token + 8 * (sequences + 1) + 128 * len(ARRAYS)


def human(n: float) -> str:
    """Bytes, readable: 1.234 GB, 56.7 MB, 890 kB, 12 B."""
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            return f"{n / size:.3g} {unit}"
    return f"{int(n)} B"


def folder_bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())


def settings_key(model_id: str, config: FeatureConfig, feature_layers: tuple[int, ...]) -> dict:
    return {"model": model_id, "top_k": config.top_k, "feature_layers": list(feature_layers),
            "target_precision": "fp32"}


def shard_key(settings: dict, examples: list[Example]) -> str:
    h = hashlib.sha256(json.dumps(settings, sort_keys=True).encode())
    for ex in examples:
        h.update(ex.id.encode())
        h.update(ex.input_ids.tobytes())
        h.update(ex.loss_mask.tobytes())
    return h.hexdigest()


@torch.inference_mode()
def target_rows(target: TargetModel, input_ids: np.ndarray, top_k: int) -> dict[str, np.ndarray]:
    """One sequence through the target (prefill, empty cache) -> its per-token arrays."""
    c = target.config
    n = len(input_ids)
    ids = torch.from_numpy(input_ids.astype(np.int64))[None]  # (1, n)
    positions = torch.arange(n)[None]
    out = target(ids, positions, torch.tensor([n - 1], dtype=torch.int32),
                 torch.tensor([n], dtype=torch.int32), torch.tensor(n, dtype=torch.int32),
                 positions, *empty_cache(c, 1, n))
    logits, hidden, eagle3 = out[0][0], out[1][0], out[2][0]  # (n, V), (n, H), (n, 3H)
    probs, top_ids = logits.float().softmax(-1).topk(top_k, dim=-1)  # (n, k) each
    rows = {"hidden": hidden, "eagle3": eagle3}
    for name, x in rows.items():
        peak = float(x.abs().max())
        if peak > FP16_MAX:
            raise ValueError(f"target {name} reaches |x| = {peak:.3g}, past fp16's {FP16_MAX:.0f}; "
                             "fp16 features cannot hold this model")
    return {"hidden": hidden.half().numpy(), "eagle3": eagle3.half().numpy(),
            "topk_ids": top_ids.int().numpy(), "topk_probs": probs.half().numpy()}


def write_shard(folder: Path, name: str, target: TargetModel, examples: list[Example],
                top_k: int) -> None:
    tmp = folder / f"{name}.tmp"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    parts: dict[str, list[np.ndarray]] = {k: [] for k in ("hidden", "eagle3", "topk_ids",
                                                           "topk_probs")}
    for ex in examples:
        for key, value in target_rows(target, ex.input_ids, top_k).items():
            parts[key].append(value)
    arrays = {k: np.concatenate(v) for k, v in parts.items()}
    arrays["input_ids"] = np.concatenate([ex.input_ids for ex in examples]).astype(np.int32)
    arrays["loss_mask"] = np.concatenate([ex.loss_mask for ex in examples]).astype(bool)
    arrays["offsets"] = np.cumsum([0] + [len(ex.input_ids) for ex in examples]).astype(np.int64)
    for key in ARRAYS:
        np.save(tmp / f"{key}.npy", arrays[key])
    final = folder / name
    if final.exists():
        shutil.rmtree(final)
    tmp.rename(final)


def write_json(path: Path, data: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1) + "\n")
    os.replace(tmp, path)


def extract(target: TargetModel, examples: list[Example], folder: Path, config: FeatureConfig,
            model_id: str, progress: Callable[[Progress], None] | None = None) -> ExtractReport:
    """Extracts every shard not yet on disk; see the module docstring."""
    if not examples:
        raise ValueError("no examples to extract features from")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    c = target.config
    settings = settings_key(model_id, config, c.eagle3_layers)
    shards = plan_shards(examples, config.shard_tokens)
    names = [f"shard_{i:05d}" for i in range(len(shards))]
    keys = [shard_key(settings, [examples[j] for j in shard]) for shard in shards]
    manifest_path = folder / "manifest.json"
    if manifest_path.exists():
        manifest = json.loads(manifest_path.read_text())
        if manifest.get("settings") != settings:
            raise ValueError(f"{folder} holds features of other settings ({manifest.get('settings')}"
                             f" != {settings}); use another folder or delete it")
        done = {k: v for k, v in manifest["done"].items()
                if k in names and v.get("key") == keys[names.index(k)]}
    else:
        done = {}  # shard name -> {"key", "sequences", "tokens"}
    manifest = {"format": FORMAT, "version": VERSION, "settings": settings,
                "plan": hashlib.sha256("".join(keys).encode()).hexdigest(),
                "config": asdict(config), "model_config": c.to_dict(),
                "feature_layers": list(c.eagle3_layers), "hidden_size": c.hidden_size,
                "num_shards": len(shards), "done": done}
    write_json(manifest_path, manifest)
    for stale in folder.iterdir():  # interrupted, changed or past the plan: removed
        if stale.is_dir() and stale.name not in done:
            shutil.rmtree(stale)
    todo = [i for i, name in enumerate(names) if name not in done]
    tokens_todo = sum(len(examples[j].input_ids) for i in todo for j in shards[i])
    start, tokens = time.perf_counter(), 0
    for i in todo:
        name = f"shard_{i:05d}"
        members = [examples[j] for j in shards[i]]
        n = sum(len(ex.input_ids) for ex in members)
        used = folder_bytes(folder)
        need = shard_bytes(n, c.hidden_size, config.top_k, len(members))
        if used + need > config.max_disk_bytes:
            raise DiskBudgetExceeded(
                f"stopping before {name}: {human(used)} on disk + {human(need)} for the next "
                f"shard would pass the {human(config.max_disk_bytes)} bound; "
                f"{len(done)} of {len(shards)} shards are done (raise the bound to go on)")
        write_shard(folder, name, target, members, config.top_k)
        done[name] = {"key": keys[i], "sequences": len(members), "tokens": n}
        write_json(manifest_path, manifest)
        tokens += n
        if progress is not None:
            elapsed = time.perf_counter() - start
            rate = tokens / elapsed if elapsed > 0 else 0.0
            progress(Progress(len(done), len(shards), tokens, tokens_todo, rate,
                              (tokens_todo - tokens) / rate if rate > 0 else float("inf")))
    return ExtractReport(len(shards), len(shards) - len(todo), tokens,
                         time.perf_counter() - start, folder_bytes(folder))


# --- reading ---------------------------------------------------------------------------

@dataclass(frozen=True)
class Sequence:
    input_ids: np.ndarray  # [n] int32
    loss_mask: np.ndarray  # [n] bool
    hidden: np.ndarray  # [n, H] fp16
    eagle3: np.ndarray  # [n, 3H] fp16
    topk_ids: np.ndarray  # [n, k] int32
    topk_probs: np.ndarray  # [n, k] fp16


class FeatureStore:
    """The finished shards of a features folder, memory-mapped."""

    def __init__(self, folder: Path):
        self.folder = Path(folder)
        path = self.folder / "manifest.json"
        if not path.exists():
            raise FileNotFoundError(f"{self.folder}: no manifest.json (not a features folder)")
        self.manifest = json.loads(path.read_text())
        if self.manifest.get("format") != FORMAT or self.manifest.get("version") != VERSION:
            raise ValueError(f"{path}: format {self.manifest.get('format')!r} version "
                             f"{self.manifest.get('version')!r}; expected {FORMAT!r} {VERSION}")
        self.shards = sorted(self.manifest["done"])
        if not self.shards:
            raise ValueError(f"{self.folder}: no finished shard")
        self.index = []  # (shard, sequence within it)
        self._arrays = {}
        for s in self.shards:
            offsets = self.arrays(s)["offsets"]
            self.index += [(s, j) for j in range(len(offsets) - 1)]

    @property
    def complete(self) -> bool:
        return len(self.shards) == self.manifest["num_shards"]

    @property
    def feature_layers(self) -> tuple[int, ...]:
        return tuple(self.manifest["feature_layers"])

    def arrays(self, shard: str) -> dict[str, np.ndarray]:
        if shard not in self._arrays:
            self._arrays[shard] = {k: np.load(self.folder / shard / f"{k}.npy", mmap_mode="r")
                                   for k in ARRAYS}
        return self._arrays[shard]

    def __len__(self) -> int:
        return len(self.index)

    def __getitem__(self, i: int) -> Sequence:
        shard, j = self.index[i]
        a = self.arrays(shard)
        lo, hi = int(a["offsets"][j]), int(a["offsets"][j + 1])
        return Sequence(*(np.asarray(a[k][lo:hi]) for k in ARRAYS if k != "offsets"))

    def __iter__(self) -> Iterator[Sequence]:
        return (self[i] for i in range(len(self)))

    @property
    def tokens(self) -> int:
        return sum(d["tokens"] for d in self.manifest["done"].values())
