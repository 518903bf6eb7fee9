"""ONNX Runtime backend: runs a target-style graph with its KV cache updated in place.

Each layer's cache buffer (a view of KVCache) is bound through IOBinding as both
`past_key_values.{i}.*` and `present.{i}.*`; GroupQueryAttention sees the shared buffer and
writes only the new rows. No step copies the cache.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import onnxruntime as ort

from trt_spec.runtime.backends.base import GraphSet, StepGraph
from trt_spec.runtime.backends.huge_pages import huge_pages, worth_it
from trt_spec.runtime.backends.int8_weights import saturates, widened_model
from trt_spec.runtime.backends.rows_free import EXTERNAL_FOLDER, rows_free_model
from trt_spec.runtime.config import ModelConfig
from trt_spec.runtime.backends.exact_rows import (FAST, Exactness, ExactnessCache, RowRule, find,
                                         probe_key)
from trt_spec.runtime.graph_io import ATTENTION_MIN_ROWS, HIDDEN_INPUT, PAST, PRESENT, kv_names
from trt_spec.runtime.kv_cache import KVCache
from trt_spec.runtime.manifest import EngineFolderError, Manifest
from trt_spec.runtime.step_inputs import SlotTokens, StepInputs


def default_threads() -> int:
    env = os.environ.get("TRT_SPEC_THREADS")
    return int(env) if env else (os.cpu_count() or 1)


_pool_threads: int | None = None  # size of the process-wide ORT thread pool, once made


def _shared_pool(threads: int) -> bool:
    """Every session of this process (target, draft, ...) runs on one ORT thread pool.

    With a pool per session, the pool that just ran keeps spinning on both cores while the
    next session starts: measured here, a 3-token target step right after draft steps took
    16 ms instead of 9. Returns False where ORT's environment already exists (the pool can
    no longer be set); sessions then get their own pools with spinning off."""
    global _pool_threads
    if _pool_threads is None:
        try:
            from onnxruntime.capi import _pybind_state

            _pybind_state.set_global_thread_pool_sizes(threads, 1)
            _pool_threads = threads
        except Exception:  # noqa: BLE001 - environment already created by someone else
            _pool_threads = 0
    return _pool_threads > 0


def graph_bytes(path: Path) -> int:
    """The size of the graph file at `path` and of its external data (path.name + "*")."""
    if not path.parent.is_dir():
        return 0
    return sum(f.stat().st_size for f in path.parent.iterdir() if f.name.startswith(path.name))


def make_session(path: Path, threads: int | None = None,
                 rewritten: bytes | None = None) -> ort.InferenceSession:
    """rewritten: the graph at `path` changed at load and serialized without its weights,
    which stay in path's folder (runtime/backends/rows_free.py); not where int8-rows' weights
    must be widened (that rewrite wins, the graph then runs as exported). The session's
    memory (its prepacked weights) goes onto huge pages where the graph is big enough
    (runtime/backends/huge_pages.py); `session.huge_page_bytes` says how much did."""
    threads = threads or default_threads()
    opts = ort.SessionOptions()
    if _shared_pool(threads):
        opts.use_per_session_threads = False
    else:
        opts.intra_op_num_threads = threads
        opts.inter_op_num_threads = 1
        opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    opts.log_severity_level = 3
    source: str | bytes = str(path)
    if saturates():  # int8-rows' weights widened for an x86 CPU without VNNI
        source = widened_model(Path(path)) or source
    if rewritten is not None and isinstance(source, str):
        source = rewritten
        opts.add_session_config_entry(EXTERNAL_FOLDER, str(Path(path).resolve().parent))
    try:
        with huge_pages(worth_it(graph_bytes(Path(path)))) as collapsed:
            session = ort.InferenceSession(source, opts, providers=["CPUExecutionProvider"])
    except Exception as e:  # ORT raises its own types; name the file in the message
        raise RuntimeError(f"ONNX Runtime cannot load {path}: {e}") from e
    session.huge_page_bytes = collapsed[0]
    return session


class OrtTarget(StepGraph):
    """A StepGraph run by ONNX Runtime over a host KVCache."""

    def __init__(self, path: Path, num_layers: int, max_positions: int, threads: int | None = None,
                 exact_decode: bool = False, cover: tuple[int, int] = (4, 6),
                 exactness_cache: ExactnessCache | None = None):
        """exact_decode: a token's logits do not depend on whether it was decoded alone or
        verified among drafts and other streams. Which row layout makes that hold on this
        machine (attention rows per request, least rows per step: runtime/backends/exact_rows.py) is
        probed at load for every step of up to cover = (streams, tokens per stream), or read
        from exactness_cache. Without exact_decode the graph runs without attention's
        minimum rows (runtime/backends/rows_free.py); should exact decoding be asked of it
        later, it is probed afresh (rows then come from padding the requests)."""
        rows_free = None if exact_decode else rows_free_model(path)
        self.session = make_session(path, threads, rows_free)
        self.exact_decode = exact_decode
        self.num_layers = num_layers
        self.max_positions = max_positions
        self.past_names = kv_names(num_layers, PAST)
        self.present_names = kv_names(num_layers, PRESENT)
        names = {i.name for i in self.session.get_inputs()}
        missing = [n for n in self.past_names if n not in names]
        if missing:
            raise ValueError(f"{path}: graph lacks inputs {missing[:4]} for {num_layers} layers")
        self.takes_hidden = HIDDEN_INPUT in names
        # exact decoding's attention rows inside the graph, else by _padded
        self.rows_in_graph = ATTENTION_MIN_ROWS in names
        # the graph's attention-rows pass taken out at load (fast decoding)
        self.rows_dropped = rows_free is not None and not self.rows_in_graph
        shapes = {o.name: o.shape for o in self.session.get_outputs()}
        # per-token outputs besides logits, in graph order
        self.outputs = [o for o in shapes if o != "logits" and o not in self.present_names]
        self.widths = {o: shapes[o][-1] for o in ["logits", *self.outputs]}  # static last dims
        self._bindings: dict[tuple[int, int, int], tuple] = {}  # see _binding
        self._fast_bindings: dict[tuple[int, int, int], tuple] = {}  # see _fast
        # a cached answer is for the graph as exported, with its rows
        self.cover = cover
        self._exactness_cache = None if self.rows_dropped else exactness_cache
        self._exactness: Exactness | None = None
        self._override: RowRule | None = None  # `using`
        if exact_decode:
            self.exactness  # noqa: B018 - probed at load, not in the first request

    @property
    def exactness(self) -> Exactness:
        """What exact decoding holds by on this machine (probed once, runtime/backends/exact_rows.py)."""
        if self._exactness is None:
            self._exactness = find(self, *self.cover, self._exactness_cache)
        return self._exactness

    @property
    def rule(self) -> RowRule:
        """The row layout steps run with now."""
        if self._override is not None:
            return self._override
        return self.exactness.rule if self.exact_decode else FAST

    @property
    def step_min_rows(self) -> int:
        return self.rule.step_min_rows

    @contextmanager
    def using(self, rule: RowRule):
        """Steps inside run with `rule` (the probe's trials)."""
        before, self._override = self._override, rule
        try:
            yield
        finally:
            self._override = before

    def _binding(self, cache: KVCache, lo: int, hi: int) -> ort.IOBinding:
        """One IOBinding per (cache, slot range), its cache views bound once as both past and
        present: a step then binds only its small inputs and outputs."""
        key = (id(cache), lo, hi)
        if key not in self._bindings:
            if len(self._bindings) >= 256:  # caches come and go (tests, benches): forget old ones
                self._bindings.clear()
            io, values = self.session.io_binding(), []
            for past, present, view in zip(self.past_names, self.present_names,
                                           cache.views(lo, hi)):
                value = ort.OrtValue.ortvalue_from_numpy(view)  # wraps the buffer, no copy
                io.bind_ortvalue_input(past, value)
                io.bind_ortvalue_output(present, value)
                values.append(value)
            self._bindings[key] = (io, values, cache)  # the values and cache stay alive with it
        return self._bindings[key][0]

    def _bind_output(self, io: ort.IOBinding, name: str, shape: tuple[int, ...]) -> np.ndarray:
        """Binds `name` to a fresh host array of `shape` that ORT writes into (no copy out)."""
        out = np.empty(shape, dtype=np.float32)
        io.bind_output(name, "cpu", 0, np.float32, list(shape), out.ctypes.data)
        return out

    def _padded(self, cache: KVCache, requests: list[SlotTokens]) -> list[SlotTokens]:
        """Every request of one new token runs as two: the token, then a copy of it whose
        row (cache row and outputs) is thrown away. ONNX Runtime's attention multiplies a
        single query row (a 1-token step, or a 1-token row of a ragged step: each row runs
        with its own query length) with MLAS's one-row SGEMM kernel and several rows with
        the general one; they round differently, and on int4 (where activations are
        quantized to int8) that difference flips near-tie tokens. With no request ever a
        single row, a token's logits are bitwise the same whether it was decoded alone or
        verified among drafts, so speculative greedy output equals plain greedy output. The
        cost is c(2)/c(1) on plain decoding steps."""
        if all(len(r.tokens) != 1 for r in requests):
            return requests
        if any(len(r.tokens) == 1 and cache.lengths[r.slot] + 2 > self.max_positions
               for r in requests):
            return requests  # the throwaway row would need a position the model lacks
        return [r if len(r.tokens) != 1 else
                SlotTokens(r.slot, r.tokens * 2, r.logits_at,
                        None if r.hidden is None else np.concatenate([r.hidden, r.hidden]))
                for r in requests]

    def prepare(self, cache: KVCache, requests: list[SlotTokens]) -> tuple[list[SlotTokens], int]:
        if not self.rule.pad_requests:
            return requests, 0
        run = self._padded(cache, requests)
        return run, int(run is not requests)  # the throwaway row may use the scratch row

    def run(self, cache: KVCache, step: StepInputs,
            want: tuple[str, ...]) -> tuple[np.ndarray, dict[str, np.ndarray], int]:
        if self.rows_in_graph:
            step.feeds[ATTENTION_MIN_ROWS] = np.array(self.rule.attention_min_rows, np.int32)
        io = self._binding(cache, step.lo, step.hi)
        for name, value in step.feeds.items():
            io.bind_cpu_input(name, value)
        batch, new_tokens = step.feeds["input_ids"].shape
        logits = self._bind_output(io, "logits", (batch, step.feeds["logits_index"].shape[1],
                                                  self.widths["logits"]))
        rows = {name: self._bind_output(io, name, (batch, new_tokens, self.widths[name]))
                for name in self.outputs}  # every output is bound: ORT writes them all
        self.session.run_with_iobinding(io)
        return logits, rows, step.lo


    def decode_one(self, cache: KVCache, slot: int, token: int,
                   rows: dict[str, np.ndarray | None] | None = None) -> np.ndarray | None:
        """Plain decoding's step for one stream: `token` appended to slot's cache rows ->
        its logits [vocab], a view of a buffer the next call overwrites; None where the step
        would not be a bare 1-token row (exact decoding's padded layouts, the cache's end),
        which the general `step` then runs. The same feeds and bitwise the same outputs as
        `step` over SlotTokens(slot, [token], [0]); what it saves is the Python between two
        session runs: its IOBinding, its inputs and outputs are bound once per (cache, slot)
        and written in place (`_fast`). rows: the per-token outputs wanted, by name (a
        switched-off drafter's stream: the rows its head catches up from); each value is set
        to the token's row [1, D], a view the next call overwrites (ORT writes every output
        anyway)."""
        logits = self._decode(cache, slot, [token], rows)
        return None if logits is None else logits[0]

    def decode_rows(self, cache: KVCache, slot: int, tokens: list[int],
                    rows: dict[str, np.ndarray | None] | None = None) -> np.ndarray | None:
        """decode_one for T = len(tokens) tokens of one stream (a verification: the last
        token and its drafts), logits at every row -> [T, vocab], a view the next call of the
        same T overwrites; rows' values [T, D], views alike. The same feeds and outputs as
        `step` over SlotTokens(slot, tokens, range(T)); None where that step would not be one
        bare row of T tokens (exact decoding's layouts, the cache's end)."""
        return self._decode(cache, slot, tokens, rows)

    def _decode(self, cache: KVCache, slot: int, tokens: list[int],
                rows: dict[str, np.ndarray | None] | None) -> np.ndarray | None:
        rule, n = self.rule, len(tokens)
        past = int(cache.lengths[slot])
        if (rule.pad_requests or rule.step_min_rows != 1 or self.takes_hidden
                or past + n > min(cache.max_len, self.max_positions)):
            return None
        unknown = [w for w in rows or () if w not in self.outputs]
        if unknown:
            raise ValueError(f"outputs {unknown} are not among this graph's {self.outputs}")
        io, feeds, logits, outputs = self._fast(cache, slot, n)
        feeds["input_ids"][0] = tokens
        feeds["position_ids"][0] = np.arange(past, past + n)
        feeds["seqlens_k"][0] = past + n - 1
        feeds["total_sequence_length"][...] = past + n
        if self.rows_in_graph:
            feeds[ATTENTION_MIN_ROWS][...] = rule.attention_min_rows
        self.session.run_with_iobinding(io)
        cache.lengths[slot] = past + n
        for name in rows or ():
            rows[name] = outputs[name][0]  # [T, D]
        return logits[0]

    def _fast(self, cache: KVCache, slot: int, n: int = 1
              ) -> tuple[ort.IOBinding, dict, np.ndarray, dict[str, np.ndarray]]:
        """decode_rows' IOBinding for (cache, slot, n tokens): the slot's cache views as past
        and present, its feeds' arrays bound as inputs and host buffers for every output
        (ORT writes them all), each bound once; the arrays are written in place by every
        step. -> (binding, feeds, logits [1, n, V], every other output by name [1, n, D])."""
        key = (id(cache), slot, n)
        if key not in self._fast_bindings:
            if len(self._fast_bindings) >= 256:
                self._fast_bindings.clear()
            io, keep = self.session.io_binding(), [cache]
            for past, present, view in zip(self.past_names, self.present_names,
                                           cache.views(slot, slot + 1)):
                value = ort.OrtValue.ortvalue_from_numpy(view)  # wraps the buffer, no copy
                io.bind_ortvalue_input(past, value)
                io.bind_ortvalue_output(present, value)
                keep.append(value)
            feeds = {"input_ids": np.zeros((1, n), np.int64),  # (B, T) = (1, n)
                     "position_ids": np.zeros((1, n), np.int64),
                     "seqlens_k": np.zeros(1, np.int32),  # (B,)
                     "query_seqlens": np.full(1, n, np.int32),
                     "total_sequence_length": np.zeros((), np.int32),
                     "logits_index": np.arange(n, dtype=np.int64)[None]}  # (B, N): every row
            if self.rows_in_graph:
                feeds[ATTENTION_MIN_ROWS] = np.ones((), np.int32)
            for name, array in feeds.items():
                value = ort.OrtValue.ortvalue_from_numpy(array)  # step writes `array`
                io.bind_ortvalue_input(name, value)
                keep.append(value)
            logits = self._bind_output(io, "logits", (1, n, self.widths["logits"]))
            outputs = {name: self._bind_output(io, name, (1, n, self.widths[name]))
                       for name in self.outputs}
            self._fast_bindings[key] = (io, feeds, logits, outputs, keep)  # keep: alive with it
        return self._fast_bindings[key][:4]


class OrtFunction:
    """A graph without a cache (Eagle3's fc): named inputs -> its first output."""

    def __init__(self, path: Path, threads: int | None = None):
        self.session = make_session(path, threads)
        self.inputs = [i.name for i in self.session.get_inputs()]

    def __call__(self, *arrays: np.ndarray) -> np.ndarray:
        return self.session.run(None, dict(zip(self.inputs, arrays)))[0]


class OrtGraphs(GraphSet):
    """The ONNX Runtime graphs of an engine folder, by manifest graph name."""

    backend = "ort"

    def __init__(self, manifest: Manifest, threads: int | None = None, exact_decode: bool = True,
                 cover: tuple[int, int] = (4, 6)):
        """cover: (streams, tokens per stream) of the largest step the exactness probe
        checks (OrtTarget); its answer is kept per engine and machine (runtime/backends/exact_rows.py)."""
        super().__init__(manifest)
        self.threads = threads
        self.exact_decode = exact_decode  # the target's (OrtTarget: exact_decode)
        self.cover = cover

    def _file(self, name: str) -> Path:
        graph = self.manifest.graph(name)
        if graph["backend"] != "ort":
            raise EngineFolderError(f"{self.manifest.folder}: graph {name!r} is for backend "
                                    f"{graph['backend']!r}; this runtime runs 'ort'")
        return self.manifest.path(graph["files"][0])

    def step_graph(self, name: str, config: ModelConfig) -> OrtTarget:
        path = self._file(name)
        exact = self.exact_decode and name == "target"
        want = [i["name"] for i in self.manifest.graph(name)["inputs"]]
        files = self.manifest.data.get("files", {})
        store = ExactnessCache.for_key(probe_key(  # only the target is probed
            {f: files.get(f, {}) for f in self.manifest.graph(name)["files"]}, self.threads)
        ) if name == "target" else None
        target = OrtTarget(path, config.num_layers, config.max_position_embeddings, self.threads,
                           exact_decode=exact, cover=self.cover, exactness_cache=store)
        got = [i.name for i in target.session.get_inputs()]
        if target.rows_dropped:
            want = [n for n in want if n != ATTENTION_MIN_ROWS]
        if want != got:
            raise EngineFolderError(f"{path}: graph inputs {got} differ from the manifest's {want}")
        return target

    def function(self, name: str) -> OrtFunction:
        return OrtFunction(self._file(name), self.threads)

    def cache(self, config: ModelConfig, slots: int, max_len: int) -> KVCache:
        return KVCache(config, slots, max_len)
