"""Exact decoding as a property of the machine: which step layout makes rows independent.

Greedy speculative output equals plain greedy output only if a token's logits are bitwise the
same whether its step ran it alone (a plain 1-token step) or among other rows (a
verification, other streams of a batch). ONNX Runtime's CPU kernels (MLAS) are picked by CPU
features, and some give a row a result that depends on the step's shape
(docs/speculative-decoding.md, "Exact decoding", has the measurements):

- GroupQueryAttention runs a request's single query row on a one-row kernel and several rows
  on the general one (every x86 CPU measured): a request needs >= 2 attention rows.
- On AVX2 without AVX-512 (MLAS's sqnbitgemm AVX2 kernels have a dedicated M = 1 int8
  kernel), MatMulNBits rounds a product of 1 row differently from one of >= 2 rows: a step
  needs >= 2 rows in all (the head's logits rows too).

A `RowRule` names a layout: attention rows per request (the graph's `attention_min_rows`,
export/attention_rows.py), the least rows of a step (the runtime pads a step's token and
logits columns, `build_step_inputs(min_rows=)`), or, for engine folders exported before the
graph took attention_min_rows, every 1-token request run as two tokens (`pad_requests`).

`probe` finds the cheapest rule that holds on this machine for the engine's own graph: for
every step shape B x T it can meet (B streams of T tokens, 1 <= B <= max_batch,
1 <= T <= max_tokens, uniform and ragged), every row's logits must equal, bit for bit, the
logits of the same token decoded in plain 1-token steps. The result (and what the rule costs
a plain step) is cached per engine, CPU, CPU features, ONNX Runtime version and threads
($TRT_SPEC_CACHE/exact-rows/), beside the step costs.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from trt_spec.runtime.config import ModelConfig
from trt_spec.runtime.speculation.cost_cache import key_hash, machine_parts
from trt_spec.runtime.backends.cpu import cpu_flags, cpu_name
from trt_spec.runtime.files import cache_dir, write_cache_file
from trt_spec.runtime.kv_cache import KVCache
from trt_spec.runtime.step_inputs import SlotTokens

if TYPE_CHECKING:
    from trt_spec.runtime.backends.ort import OrtTarget

VERSION = 1
PAST = 9  # cache rows before the probed tokens


@dataclass(frozen=True)
class RowRule:
    """How a step's rows are laid out (module docstring)."""

    attention_min_rows: int = 1  # query rows per request in attention (graph input; 1: off)
    step_min_rows: int = 1  # rows of a step at least, padding included (products, head)
    pad_requests: bool = False  # a 1-token request runs as 2 (graphs without attention rows)

    def describe(self) -> str:
        parts = []
        if self.attention_min_rows > 1:
            parts.append(f"attention rows >= {self.attention_min_rows}")
        if self.pad_requests:
            parts.append("1-token requests run as 2 tokens")
        if self.step_min_rows > 1:
            parts.append(f"step rows >= {self.step_min_rows}")
        return ", ".join(parts) or "no padding"


FAST = RowRule()  # --fast-decode: every step as it comes, one-row kernels where they apply


def candidates(rows_in_graph: bool) -> list[RowRule]:
    """The rules to try, cheapest first. Padding stops at 2 rows a step: a padded column
    needs a cache row past the stream's tokens, and a slot has one spare (KVCache's scratch
    row) for a stream at the end of its cache."""
    if rows_in_graph:
        return [FAST, RowRule(2), RowRule(2, 2)]
    return [FAST, RowRule(pad_requests=True)]


@dataclass
class Exactness:
    """What the probe found for one engine on this machine."""

    holds: bool  # a rule made every probed row bitwise equal to plain decoding
    rule: RowRule  # the rule exact decoding runs with (FAST where nothing holds)
    max_batch: int  # the shapes covered: B x T for B <= max_batch, T <= max_tokens
    max_tokens: int
    plain_ms: float  # median 1-token step at batch 1 under `rule`
    fast_ms: float  # ... under FAST (--fast-decode)
    failed: list[str] = field(default_factory=list)  # per rule tried and refused: where
    probe_s: float = 0.0
    cpu: str = ""
    cpu_flags: list[str] = field(default_factory=list)
    onnxruntime: str = ""

    @property
    def cost(self) -> float:
        """What exactness adds to a plain step, as a fraction of the fast step."""
        return self.plain_ms / self.fast_ms - 1 if self.fast_ms > 0 else 0.0

    def describe(self) -> str:
        if not self.holds:
            return ("does not hold on this machine: no row layout tried gave rows independent "
                    f"of their step ({'; '.join(self.failed)})")
        return (f"holds by {self.rule.describe()}; a plain step {self.plain_ms:.2f} ms against "
                f"{self.fast_ms:.2f} ms fast ({self.cost:+.1%}); steps up to "
                f"{self.max_batch} x {self.max_tokens} rows checked")

    def to_json(self) -> dict:
        return {**asdict(self), "rule": asdict(self.rule)}

    @classmethod
    def from_json(cls, data: dict) -> "Exactness":
        return cls(**{**data, "rule": RowRule(**data["rule"])})


def probe_config(target: "OrtTarget") -> ModelConfig:
    """The model shapes a probe cache needs, read off the graph's own inputs and outputs."""
    shapes = {i.name: i.shape for i in target.session.get_inputs()}
    _, kv_heads, _, head_dim = shapes[target.past_names[0]]
    vocab = target.widths["logits"]
    return ModelConfig(vocab_size=vocab, hidden_size=kv_heads * head_dim, intermediate_size=1,
                       num_layers=target.num_layers, num_heads=kv_heads, num_kv_heads=kv_heads,
                       head_dim=head_dim, max_position_embeddings=target.max_positions)


def shapes(max_batch: int, max_tokens: int) -> list[tuple[int, int, bool]]:
    """(B, T, ragged) to check, the likeliest to differ first: 2 rows, then by row count.
    Ragged: stream 0 decodes 1 token beside streams of T (it is padded to T columns)."""
    out = [(b, t, False) for b in range(1, max_batch + 1) for t in range(1, max_tokens + 1)
           if (b, t) != (1, 1)]
    out += [(b, t, True) for b in range(2, max_batch + 1) for t in range(2, max_tokens + 1)]
    return sorted(out, key=lambda s: (s[0] * s[1] != 2, s[0] * s[1], s[2]))


class _Probe:
    """One engine's target over a small cache of its own; runs steps under a given rule."""

    def __init__(self, target: "OrtTarget", max_batch: int, max_tokens: int, seed: int = 0):
        self.target = target
        config = probe_config(target)
        max_len = min(PAST + max_tokens + 2, target.max_positions)
        self.past = min(PAST, max_len - max_tokens - 1)
        assert self.past >= 1, (max_len, max_tokens)
        self.cache = KVCache(config, slots=max_batch, max_len=max_len)
        for _ in range(max_batch):
            self.cache.allocate()
        rng = np.random.default_rng(seed)
        vocab = config.vocab_size
        self.prompt = rng.integers(0, vocab, self.past).tolist()
        self.tokens = rng.integers(0, vocab, max_tokens).tolist()
        self.max_batch, self.max_tokens = max_batch, max_tokens
        with target.using(FAST):  # the same past in every slot
            target.step(self.cache, [SlotTokens(s, self.prompt, [self.past - 1])
                                     for s in range(max_batch)])

    def reset(self) -> None:
        self.cache.lengths[:] = self.past

    def plain(self) -> list[np.ndarray]:
        """Logits of tokens[0..] decoded one by one in slot 0: what exactness must reproduce."""
        self.reset()
        return [self.target.step(self.cache, [SlotTokens(0, [t], [0])]).logits[0][0]
                for t in self.tokens]

    def check(self, want: list[np.ndarray]) -> str:
        """'' when every shape's rows equal `want`, else the first shape that differs."""
        for b, t, ragged in shapes(self.max_batch, self.max_tokens):
            self.reset()
            counts = [1 if ragged and s == 0 else t for s in range(b)]
            out = self.target.step(self.cache, [SlotTokens(s, self.tokens[:n], list(range(n)))
                                                for s, n in enumerate(counts)])
            for s, n in enumerate(counts):
                for j in range(n):
                    if not np.array_equal(out.logits[s][j].view(np.uint32),
                                          want[j].view(np.uint32)):
                        kind = "ragged " if ragged else ""
                        return f"{kind}step {b}x{t}: stream {s} row {j}"
        return ""

    def plain_ms(self, rules: list[RowRule], rounds: int = 7, steps: int = 3) -> list[float]:
        """Median ms of a 1-token step at batch 1 under each rule, interleaved."""
        times: list[list[float]] = [[] for _ in rules]
        for _ in range(rounds):
            for i, rule in enumerate(rules):
                with self.target.using(rule):
                    self.reset()
                    t0 = time.perf_counter()
                    for j in range(steps):
                        self.target.step(self.cache, [SlotTokens(0, [self.tokens[j]], [0])])
                    times[i].append((time.perf_counter() - t0) / steps * 1e3)
        return [statistics.median(t) for t in times]


def probe(target: "OrtTarget", max_batch: int, max_tokens: int) -> Exactness:
    """The cheapest rule of `candidates` under which every probed row equals plain decoding
    (module docstring), with what it costs a plain step."""
    t0 = time.perf_counter()
    max_tokens = max(2, min(max_tokens, target.max_positions - 3))
    p = _Probe(target, max_batch, max_tokens)
    failed, chosen = [], None
    for rule in candidates(target.rows_in_graph):
        with target.using(rule):
            where = p.check(p.plain())
        if not where:
            chosen = rule
            break
        failed.append(f"{rule.describe()}: {where}")
    rule = chosen or FAST
    plain, fast = p.plain_ms([rule, FAST])
    import onnxruntime as ort

    return Exactness(chosen is not None, rule, max_batch, max_tokens, plain, fast, failed,
                     time.perf_counter() - t0, cpu_name(), list(cpu_flags()), ort.__version__)


def probe_key(target_files: dict, threads: int | None) -> str:
    """A hash of what the probe's answer depends on (cost_cache.machine_parts: the graph's
    files, the CPU, the features MLAS dispatches on, ONNX Runtime, threads)."""
    return key_hash({"version": VERSION, "probe": "exact-rows",
                     **machine_parts(target_files, threads)})


class ExactnessCache:
    """One probe's answer in a small JSON file outside the engine folder; unreadable or
    unwritable files are ignored (the probe then runs again)."""

    def __init__(self, path: Path):
        self.path = Path(path)

    @classmethod
    def for_key(cls, key: str) -> "ExactnessCache":
        return cls(cache_dir() / "exact-rows" / f"{key}.json")

    def load(self) -> Exactness | None:
        try:
            data = json.loads(self.path.read_text())
            if data.get("version") != VERSION:
                return None
            return Exactness.from_json(data["exactness"])
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def save(self, found: Exactness) -> None:
        body = json.dumps({"version": VERSION, "exactness": found.to_json()}, indent=1)
        write_cache_file(self.path, body)  # unwritable: the next process probes again


_said: set[str] = set()


def find(target: "OrtTarget", max_batch: int, max_tokens: int,
         cache: ExactnessCache | None = None) -> Exactness:
    """The cached answer when it covers max_batch x max_tokens, else a new probe (saved).
    Where exactness does not hold, says so once per process on stderr."""
    found = cache.load() if cache else None
    if found is None or found.max_batch < max_batch or found.max_tokens < max_tokens:
        found = probe(target, max(max_batch, found.max_batch if found else 0),
                      max(max_tokens, found.max_tokens if found else 0))
        if cache:
            cache.save(found)
    if not found.holds and found.cpu not in _said:
        _said.add(found.cpu)
        print(f"trt-spec: exact decoding {found.describe()}. Speculative sampling stays "
              "distribution-exact, but greedy speculative output may differ from plain "
              "greedy output at near-ties (bench's `same` column shows it).", file=sys.stderr)
    return found
