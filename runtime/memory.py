"""What an engine takes in memory, stated before it is spent: its weights, its KV caches at
`max_len` rows per slot for `slots` slots, and the total against what the machine has.

    plan = memory_plan(manifest, config, drafters)  # from the manifest: nothing is loaded
    check(plan, config.memory_utilization)          # ValueError: the numbers and what fits

A 1B-8B model's cache at its full context in fp32 for every slot does not fit most machines;
without this the server would start, reserve its cache (`KVCache.reserve`) and be killed, or
fail at its first long prompt. The counts are the runtime's own allocations, so the estimate
equals the bytes allocated (tests/test_memory.py measures them):

    KV cache (runtime/kv_cache.py)   per cache: 2 x layers x slots x kv_heads x (max_len + 1)
                                     x head_dim x itemsize; the + 1 is the scratch row padding
                                     writes to; fp32 on ort and trt, `dtype` on torch-cuda
    drafters' caches                 the same for each drafter step graph (a vanilla draft,
                                     each MTP module, Eagle, Eagle3), each over every slot:
                                     every drafter the folder has, since a request may name any
    device loop (runtime/device/)    torch-cuda, the default method's: a second target cache
                                     and its drafter's, W + 2k + 3 rows past max_len, and the
                                     token history (slots x rows int64)
    weights                          ort / trt: the folder's graph files (each file once: a
                                     drafter's embedding points into the target's data); torch-
                                     cuda: parameters counted from the model configs, x dtype

The prefix cache keeps rows in the slots above (no copies). Not counted, and what the margin
(`memory_utilization`, vLLM's gpu_memory_utilization: the share of the available memory the
total may take, 0.9 by default) is for: activations and step buffers, the Python process
itself, ONNX Runtime's prepacked int4 weights (larger than the file, docs/edge.md), and the
buffers of other (method, k) pairs on the device loop.

Available memory: host RAM (/proc/meminfo MemAvailable) where the caches live on the host
(ort; torch-cuda on the CPU), else the device's free memory (torch.cuda.mem_get_info, asked
only when that backend is used). Both are module functions, so tests can replace them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from trt_spec.runtime.config import ModelConfig
from trt_spec.runtime.kv_cache import KVCache
from trt_spec.runtime.methods import HEAD_METHODS, METHODS, DrafterEntry

if TYPE_CHECKING:
    from trt_spec.runtime.manifest import Manifest
    from trt_spec.runtime.settings import RuntimeConfig

ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2}
MAX_NUM_SEQS = 256  # `serve --max-num-seqs`'s bound: the largest slot count suggested
EXACT_ROWS = 8  # runtime/device/loop.py EXACT_ROWS (not imported: that module needs torch)
HOST = "host RAM"


@dataclass(frozen=True)
class Rows:
    """Memory that grows with slots and context: `row_bytes` per (slot, row), over max_len +
    extra_rows rows per slot (a KV cache: every layer's key and value rows)."""

    name: str
    row_bytes: int
    extra_rows: int = KVCache.scratch_rows

    def nbytes(self, slots: int, max_len: int) -> int:
        return slots * (max_len + self.extra_rows) * self.row_bytes


def kv_rows(name: str, config: ModelConfig, itemsize: int,
            extra_rows: int = KVCache.scratch_rows) -> Rows:
    """A KV cache of `config` (KVCache's block [2L, slots, kv_heads, rows, head_dim])."""
    return Rows(name, 2 * config.num_layers * config.num_kv_heads * config.head_dim * itemsize,
                extra_rows)


@dataclass(frozen=True)
class MemoryPlan:
    """What an engine will hold at `slots` x `max_len`, and where."""

    weights: dict[str, int]  # graph group (target, a drafter method) -> bytes
    rows: tuple[Rows, ...]  # the caches, each over every slot
    slots: int
    max_len: int
    model_max_len: int  # the model's max_position_embeddings: max_len's ceiling
    where: str  # HOST, or the device ("cuda", "cuda:1")
    weights_estimated: bool = False  # torch-cuda: counted from the configs, not files
    smaller: str = ""  # how the weights could take less ("" where nothing smaller is known)

    @property
    def weight_bytes(self) -> int:
        return sum(self.weights.values())

    @property
    def cache_bytes(self) -> int:
        return sum(r.nbytes(self.slots, self.max_len) for r in self.rows)

    @property
    def slot_bytes(self) -> int:
        """One slot's caches at max_len."""
        return sum(r.nbytes(1, self.max_len) for r in self.rows)

    @property
    def total(self) -> int:
        return self.weight_bytes + self.cache_bytes

    def at(self, slots: int | None = None, max_len: int | None = None) -> "MemoryPlan":
        return dataclasses.replace(self, slots=self.slots if slots is None else slots,
                                   max_len=self.max_len if max_len is None else max_len)

    def largest_max_len(self, budget: int) -> int | None:
        """The most rows per slot that fit `budget` at this slot count (None: not even 2)."""
        room = budget - self.weight_bytes
        per_row = sum(r.row_bytes for r in self.rows) * self.slots
        fixed = sum(r.nbytes(self.slots, 0) for r in self.rows)
        if per_row == 0:
            return self.model_max_len if room >= 0 else None
        n = min((room - fixed) // per_row, self.model_max_len)
        return n if n >= 2 else None

    def largest_slots(self, budget: int) -> int | None:
        """The most slots that fit `budget` at this max_len (None: not even 1)."""
        room, slot = budget - self.weight_bytes, self.slot_bytes
        n = MAX_NUM_SEQS if slot == 0 else min(room // slot, MAX_NUM_SEQS)
        return n if n >= 1 else None

    def table(self, have: int | None = None) -> list[str]:
        """The plan as `serve` and `doctor` print it, one row per weight group and cache;
        have: the bytes available, if known."""
        how = ", estimated from the configs" if self.weights_estimated else ""
        rows = [(f"weights: {k}{how if k == 'target' else ''}", "", size(v))
                for k, v in self.weights.items()]
        rows += [(f"KV cache: {r.name}", size(r.nbytes(1, self.max_len)),
                  size(r.nbytes(self.slots, self.max_len))) for r in self.rows]
        of = "" if not have else \
            f" of the {size(have)} available ({percent(self.total / have)})"
        rows.append(("total", size(self.slot_bytes), size(self.total)))
        width = max(len(r[0]) for r in rows)
        return ([f"memory on {self.where}: {self.slots} slots (--max-num-seqs) x "
                 f"{self.max_len} rows (--max-model-len)",
                 f"  {'':{width}}  {'per slot':>10}  {'total':>10}"]
                + [f"  {a:{width}}  {b:>10}  {c:>10}" for a, b, c in rows[:-1]]
                + [f"  {'total':{width}}  {rows[-1][1]:>10}  {rows[-1][2]:>10}{of}"])

    def to_json(self) -> dict:
        return {"where": self.where, "max_num_seqs": self.slots, "max_model_len": self.max_len,
                "weights": dict(self.weights), "weights_estimated": self.weights_estimated,
                "kv_cache": {r.name: r.nbytes(self.slots, self.max_len) for r in self.rows},
                "kv_cache_per_slot": self.slot_bytes, "total": self.total}


def percent(x: float) -> str:
    """0.9 -> 90%, 0.0002 -> 0.02%."""
    return f"{x * 100:.3g}%"


def size(n: int) -> str:
    """Bytes for people: 1.50 GiB, 96.0 MiB, 12.0 KiB."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}" if unit == "GiB" else f"{n / scale:.1f} {unit}"
    return f"{n} B"


# --- what the runtime allocates --------------------------------------------------------------

Drafters = dict[str, DrafterEntry]  # the folder's (runtime/generator.py drafter_entries)


def cache_rows(manifest: "Manifest", config: "RuntimeConfig",
               drafters: Drafters) -> tuple[Rows, ...]:
    """Every cache the Generator and its proposers allocate (runtime/generator.py `cache`,
    `cache_for`; runtime/methods.py: one per drafter step graph), and the device loop's."""
    itemsize = ITEMSIZE[config.dtype] if config.backend == "torch-cuda" else 4
    rows = [kv_rows("target", manifest.config, itemsize)]
    for method, entry in drafters.items():
        rows += [kv_rows(g, entry.config, itemsize) for g in entry.graphs]
    device = config.executor == "device" or (config.executor == "auto"
                                             and not str(config.device).startswith("cpu"))
    if (config.backend == "torch-cuda" and device
            and METHODS[config.method].device is not None):
        k = config.speculation.num_draft_tokens if METHODS[config.method].speculative else 0
        width = max(EXACT_ROWS, k + 1) if config.exact_decode else k + 1
        extra = width + 2 * k + 2  # DeviceLoop.length - max_len; its caches: one row more
        rows.append(kv_rows("device loop target", manifest.config, itemsize, extra + 1))
        entry = drafters.get(config.method)  # (a model drafter's: its own caches there)
        if entry is not None:
            rows += [kv_rows(f"device loop {g}", entry.config, itemsize, extra + 1)
                     for g in entry.graphs]
        rows.append(Rows("device loop tokens", 8, extra))  # DeviceState.seq, int64
    return tuple(rows)


def file_bytes(manifest: "Manifest", names) -> int:
    files = manifest.data.get("files", {})
    return sum(files.get(f, {}).get("bytes", 0) for f in names)


def weight_bytes(manifest: "Manifest", config: "RuntimeConfig",
                 drafters: Drafters) -> tuple[dict[str, int], bool]:
    """(bytes per graph group: target, then each drafter; estimated?). ort: the graphs' files,
    each file counted once (where two groups share one, the first); trt: the engines built, the
    ONNX files of the others; torch-cuda: parameters from the configs x the dtype."""
    groups = {"target": ["target"]}
    for method, entry in drafters.items():
        groups[method] = entry.all_graphs
    if config.backend == "torch-cuda":
        itemsize = ITEMSIZE[config.dtype]
        out = {"target": parameters(manifest.config) * itemsize}
        for method, entry in drafters.items():
            out[method] = drafter_parameters(method, entry, manifest.config) * itemsize
        return out, True
    engines = manifest.data.get("trt", {}).get("engines", {}) if config.backend == "trt" else {}
    seen: set[str] = set()
    out = {}
    for group, graphs in groups.items():
        names = []
        for g in graphs:
            names += ([engines[g]["file"]] if g in engines else
                      manifest.data["graphs"].get(g, {}).get("files", []))
        new = [f for f in dict.fromkeys(names) if f not in seen]
        seen.update(new)
        out[group] = file_bytes(manifest, new)
    return out, False


def parameters(c: ModelConfig, layers: int | None = None, qkv_in: int | None = None,
               embedding: bool = True, head_vocab: int | None = None) -> int:
    """Parameters of export/model.py's modules: the embedding, `layers` decoder layers (q/k/v
    over qkv_in inputs), the final norm and an untied head (head_vocab rows)."""
    h, d = c.hidden_size, c.head_dim
    q, kv = c.num_heads * d, c.num_kv_heads * d
    layer = ((qkv_in or h) * (q + 2 * kv) + q * h + 3 * h * c.intermediate_size
             + (2 + 2 * c.sandwich_norm) * h + 2 * d * c.qk_norm
             + (q + 2 * kv) * c.attention_bias)
    n = (c.num_layers if layers is None else layers) * layer + h
    n += c.vocab_size * h if embedding else 0
    if not c.tie_word_embeddings or head_vocab is not None:
        n += (head_vocab or c.vocab_size) * h
    return n


def drafter_parameters(method: str, entry: DrafterEntry, target: ModelConfig) -> int:
    """export/drafters.py's modules: a vanilla draft is a model; each head module one layer
    with its own embedding (MTP, Eagle: a 2H -> H projection; Eagle3: q/k/v over 2H inputs, a
    3H -> H fc). Over a draft vocabulary, each has a head of its own over it."""
    c, h = entry.config, entry.config.hidden_size
    if method not in HEAD_METHODS:  # a draft model
        return parameters(c, head_vocab=entry.draft_vocab_size)
    if entry.fc_graph is not None:  # eagle3
        return (parameters(c, 1, 2 * h, head_vocab=entry.draft_vocab_size) + h
                + 3 * target.hidden_size * h)
    return len(entry.graphs) * (parameters(c, 1, head_vocab=entry.draft_vocab_size)
                                + 2 * h * h + 2 * h)


# --- what the machine has ------------------------------------------------------------------

def host_available() -> int | None:
    """MemAvailable of /proc/meminfo in bytes (None where there is none: not Linux)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def gpu_available(device: str) -> int | None:
    """The free memory of a CUDA device (torch, imported only here); None without one."""
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    free, _total = torch.cuda.mem_get_info(torch.device(device))
    return int(free)


def available(where: str) -> int | None:
    return host_available() if where == HOST else gpu_available(where)


def device_of(config: "RuntimeConfig") -> str:
    """Where the weights and caches live: HOST for ort (and torch-cuda on the CPU), else the
    device (the torch-cuda default, cuda where torch sees one, asks torch)."""
    if config.backend == "ort":
        return HOST
    device = config.device
    if device is None:
        if config.backend == "trt":
            device = "cuda"
        else:
            import torch

            device = "cuda" if torch.cuda.is_available() else "cpu"
    return HOST if device.startswith("cpu") else device


# --- the plan and the check --------------------------------------------------------------

def memory_plan(manifest: "Manifest", config: "RuntimeConfig", drafters: Drafters,
                where: str | None = None) -> MemoryPlan:
    """The plan of `config` on `manifest`'s engine with its `drafters` (max_len capped by the
    model, as the Generator caps it). where: HOST or a device (default: device_of(config))."""
    where = device_of(config) if where is None else where
    weights, estimated = weight_bytes(manifest, config, drafters)
    model_max = manifest.config.max_position_embeddings
    return MemoryPlan(weights, cache_rows(manifest, config, drafters), config.max_batch,
                      min(config.max_len, model_max), model_max, where, estimated,
                      smaller_weights(manifest, config))


def smaller_weights(manifest: "Manifest", config: "RuntimeConfig") -> str:
    """The setting that makes the weights smaller: a half dtype on torch-cuda, else an int4
    export (where the target is not int4 already)."""
    if config.backend == "torch-cuda":
        return 'dtype="bfloat16" (LLM and RuntimeConfig: half the weights and caches)' \
            if config.dtype == "float32" else ""
    precision = manifest.data["graphs"]["target"].get("precision", "")
    return "" if precision.startswith("int4") else \
        f"an int4 export (trt-spec export --precision int4; this one is {precision or 'fp'})"


def check(plan: MemoryPlan, utilization: float, have: int | None = None) -> int | None:
    """-> the bytes available (None: unknown, nothing checked). ValueError when the plan's
    total is more than `utilization` of them, naming the numbers and the settings that fit.
    have: the available bytes (default: asked of the machine, `available`)."""
    have = available(plan.where) if have is None else have
    if have is None:
        return None
    budget = int(have * utilization)
    if plan.total <= budget:
        return have
    raise ValueError(refusal(plan, have, utilization))


def refusal(plan: MemoryPlan, have: int, utilization: float) -> str:
    """The message of a plan that does not fit: the numbers, then what would."""
    lines = [f"this engine needs {size(plan.total)} of memory, more than "
             f"{percent(utilization)} (--memory-utilization) of the {size(have)} available on "
             f"{plan.where}:", *plan.table(), "What would fit:"]
    return "\n".join(lines + [f"  - {f}" for f in what_fits(plan, int(have * utilization))])


def what_fits(plan: MemoryPlan, budget: int) -> list[str]:
    """The settings under which `plan` takes at most `budget` bytes: the longest context at
    this slot count, the most slots at this context, smaller weights, fewer drafters."""
    fits = []
    n = plan.largest_max_len(budget)
    if n is not None and n < plan.max_len:
        fits.append(f"--max-model-len {n} at --max-num-seqs {plan.slots}")
    s = plan.largest_slots(budget)
    if s is not None and s < plan.slots:
        fits.append(f"--max-num-seqs {s} at --max-model-len {plan.max_len}")
    if plan.weight_bytes > budget or not fits:
        what = (f"the weights alone ({size(plan.weight_bytes)}) do not fit"
                if plan.weight_bytes > budget else "no context of 2 rows fits beside them")
        fits.append(f"{what}: {plan.smaller or 'a smaller model'}")
    elif plan.smaller:
        fits.append(plan.smaller)
    if len(plan.weights) > 1:
        fits.append("fewer drafters (trt-spec bundle --methods ...): each drafter's cache is "
                    "allocated for every slot")
    fits.append("--memory-utilization above 1 to go past what is available (swap), at your "
                "own risk")
    return fits
