"""The device executor of the torch backends (torch-cuda; trt once its backend declares a
device runner): drafts, verification and sampling stay on the device; each step copies back
only the emitted tokens and counts, with one synchronisation. The scheduler
(runtime/scheduler.py) admits, steps and retires the streams; runtime/executors.py decides
which of them this executor steps.

    DeviceExecutor.step(streams, prefill_budget):  # one scheduler step, per method loop
        new streams: the next chunk of each prompt  # runtime/device/prefill.py: one forward,
                     (from a prefix-cache hit's or  #   eager; after the last chunk, the first
                     choice 0's rows, slot copies)  #   token sampled on the device
        the others:
            plan     k per stream, on the host      # runtime/device/k_buckets.py: the
                                                    # planner's; a step runs at a k bucket
            propose  drafts [B, k] (+ q)            # runtime/device/drafters.py (a host
                                                    # drafter's uploaded: host_drafts.py)
            score    target over [last, d1..dk] (W rows)
            sample   verify + commit on the device  # runtime/device/verify.py
            host <- tokens [B, k + 1], counts [B]   # the one sync of the step
        append, stop checks; finished streams' slots idle here, freed on the host

State on the device, per cache slot: the token history `seq` (prompt, output, then scratch
drafts), `n` (tokens known: the target's cache holds n - 1 rows), `active`, the sampling
settings; the KV caches of the target and the drafters; the drafters' own bookkeeping. Every
tensor has a fixed address and every step over slots [0, nb) has fixed shapes, so on CUDA each
phase (propose, score, sample) of a step is captured once per (nb, k bucket) as a CUDA graph
(the first step of a shape runs eagerly and is the warm-up) and replayed: three launches a
step, whatever the drafter. A graph runner is a StepGraph that is a DeviceRunner
(backends/base.py) over a GraphSet that is a DeviceGraphs (the torch-cuda backend's modules).

Exact decoding (the runtime's `exact_decode`, on by default): matrix kernels give a row
results that depend on how many rows run with it (cuBLAS and MKL pick kernels by shape), so
every decode / verify forward of a run has one shape, [nb, W] with W = max(EXACT_ROWS, k + 1),
plain decoding included: plain and speculative greedy output are then the same token for token
for any k < EXACT_ROWS. Without it (`--fast-decode`) W = k + 1.

What the executor does not take is listed once, in runtime/executors.py fallback_reason.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

from trt_spec.runtime import sampling_torch
from trt_spec.runtime.device import k_buckets, prefill, prompt_logprobs
from trt_spec.runtime.device import verify as device_verify
from trt_spec.runtime.device.controls import DeviceControls
from trt_spec.runtime.device.host_drafts import HostDrafts
from trt_spec.runtime.device.masks import DeviceMasks, guide_masks
from trt_spec.runtime.stream import (StepMetrics, Stream, append, fail, finish_unsampled,
                                     prefill_chunks)
from trt_spec.runtime.provenance import step_sources
from trt_spec.runtime.graph_io import HIDDEN_INPUT
from trt_spec.runtime.methods import METHODS
from trt_spec.runtime.speculation.planner import Verified

EXACT_ROWS = 8  # exact decoding: every decode / verify forward runs this many rows (or k + 1)
# method loops the device executor keeps at most: each holds a target KV cache of its own
# (and its drafter's), so a server whose clients ask for many methods stays bounded (any k
# of a method runs on its loop: runtime/device/k_buckets.py)
MAX_LOOPS = 4


@dataclass
class DeviceState:
    """Per cache slot, on the device."""

    seq: torch.Tensor  # [slots, length] int64: prompt + output (+ drafts, scratch); col -1: dump
    n: torch.Tensor  # [slots] int64 tokens known
    active: torch.Tensor  # [slots] bool
    temperature: torch.Tensor  # [slots] f32 (> 0; greedy rows: 1)
    top_k: torch.Tensor  # [slots] int64 (0: off)
    top_p: torch.Tensor  # [slots] f32 (1: off)
    greedy: torch.Tensor  # [slots] bool
    end: torch.Tensor  # [slots] int64 prompt + max_tokens: no draft past what may be emitted
    seed: torch.Tensor  # [slots] int64 the stream's seed (uint64 bits): the race's noise
    start: torch.Tensor  # [slots] int64 the prompt's length: output position = seq index - start
    cap: torch.Tensor  # [slots] int64 the most this step drafts per slot (the planner's k)


class DeviceLoop:
    """One Generator's device loop for one method, at most k drafts a step (k_max; each
    step's k: runtime/device/k_buckets.py): caches, state and graphs."""

    def __init__(self, gen, method: str, k: int, exact: bool = True):
        self.gen = gen
        self.method, self.k, self.k_max = method, k, k  # k: this step's bucket (<= k_max)
        self.target = gen.target
        self.device = torch.device(gen.graphs.device)  # a DeviceGraphs (runtime/executors.py backend_reason)
        self.dtype = gen.graphs.dtype
        self.vocab_size = gen.config.vocab_size
        self.slots = gen.cache.slots
        self.max_len = gen.cache.max_len
        self.width = max(EXACT_ROWS, k + 1) if exact else k + 1  # W: rows of a verify forward
        # rows past max_len a step may write: the verify rows, drafts, the heads' loop rows
        self.length = self.max_len + self.width + 2 * k + 2
        self.use_graphs = self.device.type == "cuda" and gen.graphs.cuda_graphs
        dev = self.device
        self.state = DeviceState(
            seq=torch.zeros(self.slots, self.length, dtype=torch.long, device=dev),
            n=torch.zeros(self.slots, dtype=torch.long, device=dev),
            active=torch.zeros(self.slots, dtype=torch.bool, device=dev),
            temperature=torch.ones(self.slots, dtype=torch.float32, device=dev),
            top_k=torch.zeros(self.slots, dtype=torch.long, device=dev),
            top_p=torch.ones(self.slots, dtype=torch.float32, device=dev),
            greedy=torch.ones(self.slots, dtype=torch.bool, device=dev),
            end=torch.zeros(self.slots, dtype=torch.long, device=dev),
            seed=torch.zeros(self.slots, dtype=torch.long, device=dev),
            start=torch.zeros(self.slots, dtype=torch.long, device=dev),
            cap=torch.full((self.slots,), k, dtype=torch.long, device=dev))
        self.cache = self.new_cache(gen.config)
        self.drafter = METHODS[method].device(self, gen, method)  # its device face
        # a host drafter's drafts, made on the host each step (runtime/device/host_drafts.py)
        self.hosted = HostDrafts(self, gen, method) if METHODS[method].host_drafts else None
        self.any_sampled, self.filtered, self.controlled, self.guided = (False,) * 4
        self.controls: DeviceControls | None = None  # made for the first request with one
        self.masks: DeviceMasks | None = None  # made for the first guided request
        self.graphs: dict[tuple, tuple] = {}  # (nb, flags) -> (graphs, static outputs)
        self.pool = None
        self.kept = prefill.Kept()  # released slots' rows, still valid in these caches
        self.stats = {"steps": 0, "eager_steps": 0, "replayed": 0, "captured": 0}

    # --- building blocks ----------------------------------------------------------------------

    def new_cache(self, config) -> list[torch.Tensor]:
        """2L buffers [slots, kv_heads, length + 1, head_dim] (the last row: padding's scratch
        row, export/torch_backend.py attention_in_place)."""
        shape = (self.slots, config.num_kv_heads, self.length + 1, config.head_dim)
        return [torch.zeros(shape, dtype=self.dtype, device=self.device)
                for _ in range(2 * config.num_layers)]

    def forward(self, graph, cache: list[torch.Tensor], lo: int, hi: int, ids: torch.Tensor,
                past: torch.Tensor, q: torch.Tensor, logits_index: torch.Tensor,
                hidden: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
        """One forward of `graph` over slots [lo, hi): ids [B, T] at positions past + 0..T-1,
        the first q [B] of them new (the rest padding, q = 0: an idle row); logits at
        logits_index [B, N]. -> (logits [B, N, V], per-token outputs [B, T, D] ...)."""
        t = ids.shape[1]
        # padding columns repeat the last new token's position (step_inputs.py's rule)
        cols = torch.minimum(torch.arange(t, device=ids.device)[None], (q - 1).clamp(min=0)[:, None])
        positions = (past[:, None] + cols).clamp(0, graph.max_positions - 1)
        seqlens_k = (past + q - 1).clamp(min=0).to(torch.int32)
        inputs = {"input_ids": ids, "position_ids": positions, "seqlens_k": seqlens_k,
                  "query_seqlens": q.to(torch.int32),
                  "total_sequence_length": (seqlens_k.max() + 1).to(torch.int32),
                  "logits_index": logits_index}
        if hidden is not None:
            inputs[HIDDEN_INPUT] = hidden.to(self.dtype)
        return graph.device_forward(inputs, [c[lo:hi] for c in cache])

    def write_tokens(self, nb: int, at: torch.Tensor, tokens: torch.Tensor) -> None:
        """seq[b, at[b]] = tokens[b] for the active slots of [0, nb)."""
        at = torch.where(self.state.active[:nb], at, self.length - 1).clamp(max=self.length - 1)
        self.state.seq[:nb].scatter_(1, at[:, None], tokens[:, None])

    # --- prefill (runtime/device/prefill.py reads the prompts) ---------------------------------

    def first_tokens(self, streams: list[Stream], lo: int, logits: torch.Tensor
                     ) -> torch.Tensor:
        """Each prefilled stream's first token from logits [B, 1, V] (slots lo..), after its
        controls: the argmax, or the race of its seed at output position 0 (the host
        executor's token, runtime/race.py), drawn as sample_for(streams) set."""
        s = self.state
        hi = lo + logits.shape[0]
        if any(st.guide is not None for st in streams):  # its grammar's first row (masks.py)
            logits = guide_masks(self, streams, False).admit(streams, lo, hi).apply(logits, lo)
        if any(st.params.controls for st in streams):
            logits = self.controls.apply(logits, lo, hi, None, sampling_torch.temperature_or_one(
                s.temperature[lo:hi], s.greedy[lo:hi]))
        position = torch.zeros(hi - lo, 1, dtype=torch.long, device=self.device)
        return self.tokens(logits, slice(lo, hi), position)[:, 0]

    def sample_for(self, streams: list[Stream]) -> None:
        """Sets how the next tokens of `streams` are drawn (`tokens`; a step's graphs' key):
        whether any of them samples, whether any filters by top-k / top-p."""
        sampled = [st.params for st in streams if not st.params.greedy]
        self.any_sampled = bool(sampled)
        self.filtered = any(p.top_k > 0 or p.top_p < 1.0 for p in sampled)

    def tokens(self, logits: torch.Tensor, slots: slice, position: torch.Tensor,
               ids: torch.Tensor | None = None) -> torch.Tensor:
        """The token of each row of logits [B, R, V'] of `slots` at output positions
        position [B, R]: argmax (greedy), else the race of the slot's seed there
        (runtime/device/verify.py target_tokens; ids: a draft vocabulary's target ids)."""
        s = self.state
        return device_verify.target_tokens(
            logits, s.temperature[slots], s.top_k[slots] if self.filtered else None,
            s.top_p[slots] if self.filtered else None, s.greedy[slots], s.seed[slots], position,
            self.any_sampled, ids, self.vocab_size)

    # --- one step --------------------------------------------------------------------------------

    def _propose(self, nb: int, out: dict) -> None:
        if self.drafter is None:
            z = torch.zeros(nb, self.k, dtype=torch.long, device=self.device)
            out.update(drafts=z, valid=z.bool())
            return
        drafts, valid = self.drafter.propose(self, nb)
        drafts, valid = drafts[:, :self.k], valid[:, :self.k]  # (heads draft >= N)
        # policy.py's room: below the remaining max_tokens and the cache rows left; the cap
        n = self.state.n[:nb]
        room = torch.minimum(self.state.end[:nb] - n - 1, self.max_len - n)  # (nb,)
        room = torch.minimum(room, self.state.cap[:nb])
        valid = valid & (torch.arange(self.k, device=self.device)[None] < room[:, None])
        out["drafts"], out["valid"] = torch.where(valid, drafts, 0), valid

    def _score(self, nb: int, out: dict) -> None:
        s = self.state
        n, active = s.n[:nb], s.active[:nb]
        last = s.seq[:nb].gather(1, (n - 1).clamp(min=0)[:, None])  # (nb, 1)
        # padding and invalid drafts repeat the last token, so every row carries a real
        # token's activations (no never-trained id such as 0 in the rows nobody reads)
        drafts = torch.where(out["valid"], out["drafts"], last)
        pad = last.expand(nb, self.width - 1 - self.k)
        ids = torch.cat([last, drafts, pad], 1)  # (nb, W)
        q = torch.where(active, self.k + 1, 0)
        index = torch.arange(self.width, device=self.device).expand(nb, -1)
        res = self.forward(self.target, self.cache, 0, nb, ids, (n - 1).clamp(min=0), q, index)
        out["logits"] = res[0]
        out["rows"] = dict(zip(self.target.outputs, res[1:]))

    def _sample(self, nb: int, out: dict) -> None:
        s = self.state
        active = s.active[:nb]
        logits = out["logits"]
        if self.guided:  # the grammars' bits, uploaded before this phase (masks.py)
            logits = self.masks.apply(logits[:, :self.k + 1], 0)
        if self.controlled:  # the request's controls on every verified row (controls.py)
            logits = self.controls.apply(logits[:, :self.k + 1], 0, nb, out["drafts"],
                                         sampling_torch.temperature_or_one(
                                             s.temperature[:nb], s.greedy[:nb]))
        tokens, accepted = device_verify.verify(
            out["drafts"], out["valid"], logits, s.temperature[:nb],
            s.top_k[:nb] if self.filtered else None, s.top_p[:nb] if self.filtered else None,
            s.greedy[:nb], s.seed[:nb], s.n[:nb] - s.start[:nb], self.any_sampled)
        n_old = s.n[:nb].clone()
        cols = torch.arange(self.k + 1, device=self.device)
        keep = (cols[None] <= accepted[:, None]) & active[:, None]
        at = torch.where(keep, n_old[:, None] + cols, self.length - 1).clamp(max=self.length - 1)
        s.seq[:nb].scatter_(1, at, tokens)
        if self.controlled:
            self.controls.count(0, nb, tokens, keep)
        s.n[:nb] = torch.where(active, n_old + accepted + 1, n_old)
        if self.drafter is not None:
            self.drafter.commit(self, nb, n_old, accepted, out["rows"])
        proposed = out["valid"].sum(-1)
        # what the host reads: [tokens (k + 1) | accepted | proposed]
        out["host"] = torch.cat([tokens, accepted[:, None], proposed[:, None]], 1)

    PHASES = ("propose", "score", "sample")

    def _phases(self, nb: int, timed: bool) -> tuple[dict, list[float]]:
        """Runs the three phases eagerly -> (outputs, seconds per phase when timed)."""
        out, seconds = {}, []
        for phase, fn in zip(self.PHASES, (self._propose, self._score, self._sample)):
            t = time.perf_counter()
            fn(nb, out)
            self._between(phase, nb, out)
            if timed:
                if self.device.type == "cuda":
                    torch.cuda.synchronize(self.device)
                seconds.append(time.perf_counter() - t)
        return out, seconds

    def _between(self, phase: str, nb: int, out: dict) -> None:
        """The host's work after a phase: a guided step's drafts fetched after propose, its
        masks uploaded after score (runtime/device/masks.py)."""
        if self.guided and phase == "propose":
            self.masks.fetch(out)
        elif self.guided and phase == "score":
            self.masks.upload(nb)

    def _capture(self, key: tuple, nb: int) -> None:
        """One CUDA graph per phase over slots [0, nb); a later phase reads the static outputs
        of the earlier ones (one memory pool, captured and replayed in order)."""
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        out, graphs = {}, []
        for fn in (self._propose, self._score, self._sample):
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=self.pool):
                fn(nb, out)
            graphs.append(g)
        self.graphs[key] = (graphs, out)
        self.stats["captured"] += 1

    def step(self, nb: int) -> tuple[np.ndarray, list[float], torch.Tensor]:
        """One propose -> score -> sample over slots [0, nb) -> (host array [nb, k + 3]:
        emitted tokens, accepted, proposed; seconds of each phase; the target's logits
        [nb, W, V] on the device, before the controls: logprobs read them)."""
        self.stats["steps"] += 1
        key = (nb, self.k, self.any_sampled, self.filtered, self.controlled, self.guided)
        entry = self.graphs.get(key) if self.use_graphs else None
        if entry is None:
            self.stats["eager_steps"] += 1
            if self.use_graphs:  # the first step of this shape is the warm-up: a real step
                side = torch.cuda.Stream(self.device)
                side.wait_stream(torch.cuda.current_stream(self.device))
                with torch.cuda.stream(side):
                    out, seconds = self._phases(nb, timed=True)
                    host = out["host"].cpu().numpy()
                torch.cuda.current_stream(self.device).wait_stream(side)
                logits = out["logits"].clone()  # (the capture below writes new buffers)
                self._capture(key, nb)
                return host, seconds, logits
            out, seconds = self._phases(nb, timed=True)
            return out["host"].cpu().numpy(), seconds, out["logits"]
        graphs, out = entry
        events = [torch.cuda.Event(enable_timing=True) for _ in range(4)]
        events[0].record()
        for phase, g, e in zip(self.PHASES, graphs, events[1:]):
            g.replay()
            e.record()
            self._between(phase, nb, out)
        host = out["host"].cpu()  # the one sync of the step (after every event above)
        self.stats["replayed"] += 1
        return (host.numpy(), [a.elapsed_time(b) / 1e3 for a, b in zip(events, events[1:])],
                out["logits"])



class DeviceExecutor:
    """The device executor (runtime/executors.py): executes one scheduler step of the streams
    the scheduler chose for it, each on the DeviceLoop of its method, made on first use
    (its state, caches and graphs), at the k the host's planner gives it each step
    (runtime/device/k_buckets.py). Admission, retirement and the queue are the scheduler's;
    slots are the Generator's cache's (a slot is active in one loop at a time)."""

    def __init__(self, gen):
        self.gen = gen
        self.loops: dict[str, DeviceLoop] = {}
        self.planner = k_buckets.DevicePlanner(self)

    def loop(self, s: Stream) -> DeviceLoop:
        if s.method not in self.loops:
            k = max(s.num_draft_tokens, self.gen.speculation.num_draft_tokens)
            self.loops[s.method] = DeviceLoop(self.gen, s.method, k if METHODS[s.method].speculative
                                              else 0, exact=self.gen.settings.exact_decode)
        return self.loops[s.method]

    def reserve(self, s: Stream) -> bool:
        """Makes s's loop, where it has none (or an idle one drafts fewer than s's k: made
        again), dropping an idle one (its caches and graphs) at the bound; False when every
        loop is busy (s then runs on the host). A busy loop of fewer drafts than s's k
        drafts at most its own for s (k_buckets.set_step_k)."""
        busy = {r.method for r in self.gen.engine.running.values()
                if r.executor == "device"}  # (admitted: prefilled or not yet)
        have = self.loops.get(s.method)
        if have is not None and have.k_max < s.num_draft_tokens and s.method not in busy:
            del self.loops[s.method]
        if s.method not in self.loops and len(self.loops) >= MAX_LOOPS:
            idle = [m for m in self.loops if m not in busy]
            if not idle:
                return False
            del self.loops[idle[0]]
        self.loop(s)
        return True

    def groups(self, streams: list[Stream]) -> list[tuple[DeviceLoop, list[Stream]]]:
        by = {}
        for s in streams:
            by.setdefault(id(self.loop(s)), (self.loop(s), []))[1].append(s)
        return list(by.values())

    def admit(self, s: Stream, source: Stream | None) -> None:
        """s, its slot allocated, joins its loop: a fork of source (choice 0 of its request)
        or a prefix-cache hit starts it from rows on the device (runtime/device/prefill.py)."""
        prefill.admit(self, self.loop(s), s, source)

    def step(self, streams: list[Stream], prefill_budget: int | None = None) -> StepMetrics:
        """Reads the next chunk of the new streams' prompts (prefill_budget tokens in all, one
        forward per loop), then one propose -> score -> sample step of every other, per loop;
        finished streams are freed."""
        t0 = time.perf_counter()
        active = [s for s in streams if not s.finished]
        new = [s for s in active if not s.prefilled and s.fork_of is None]
        old = [s for s in active if s.prefilled]
        chunks = prefill_chunks(new, prefill_budget)
        m = StepMetrics(len(chunks), sum(n for _, n in chunks), len(old),
                        device_streams=len(active))
        with torch.no_grad():
            read = [(loop, self.prefill(loop, [c for c in chunks if c[0].slot in slots(group)],
                                        active, m))
                    for loop, group in self.groups([s for s, _ in chunks])]
            m.prefill_s = time.perf_counter() - t0
            if old:  # k per stream planned on the host, `decode` per loop
                k_buckets.decode(self, old, m)
            for loop, firsts in read:
                prefill.activate(loop, firsts)
        m.total_s = time.perf_counter() - t0
        return m

    def prefill(self, loop: DeviceLoop, chunks: list[tuple[Stream, int]], active: list[Stream],
                m: StepMetrics) -> list[Stream]:
        """One forward over the chunks; a stream whose prompt is read emits its first token
        and its waiting choices fork from its rows -> those streams."""
        firsts = prefill.read(loop, chunks)
        m.target_forwards += 1
        for s, token, row in firsts:
            prefill.fork(loop, s, active, self.gen.prefix_cache)
            s.stats.record(0, 0)
            if s.fault is not None:  # its grammar raised (masks.py): it fails alone
                fail(s, s.fault)
            elif s.params.max_tokens == 0:  # the prompt only: read, nothing sampled
                finish_unsampled(s)
            else:
                append(s, [token], self.gen.stops, host_rows(row[None], 0, 1, s),
                       step_sources(0, None, 0, 0, 1))
            if s.finished:
                self.release(s)
        return [s for s, _, _ in firsts]

    def decode(self, loop: DeviceLoop, streams: list[Stream], m: StepMetrics) -> list[Verified]:
        """One step of `streams`: every running stream of `loop` (its graphs' key: its k
        bucket, whether any samples, any filters) -> what each verified."""
        loop.sample_for(streams)
        loop.controlled = any(s.params.controls for s in streams)
        loop.guided = guide_masks(loop, streams) is not None
        hosted = loop.hosted
        drafts = hosted.draft(loop, streams) if hosted else None  # uploaded
        host, seconds, logits = loop.step(max(s.slot for s in streams) + 1)
        if hosted:
            seconds = [seconds[0] + hosted.draft_s, *seconds[1:]]
        m.target_forwards += 1
        m.mask_s += loop.masks.spent() if loop.guided else 0.0
        m.propose_s, m.score_s, m.sample_s = (a + b for a, b in zip(
            (m.propose_s, m.score_s, m.sample_s), seconds))
        rows = [host[s.slot] for s in streams]  # (a finished stream's slot is freed below)
        verified = []
        for i, (s, row) in enumerate(zip(streams, rows)):
            accepted, proposed = int(row[-2]), int(row[-1])
            verified.append(Verified(proposed, accepted, row[:accepted + 1]))
            if s.fault is not None:  # its grammar raised (masks.py): it fails alone
                fail(s, s.fault)
                self.release(s)
                continue
            s.stats.record(proposed, accepted)
            m.verified(proposed, accepted)
            step = s.stats.target_forwards - 1
            if hosted:  # its draft as the device verified it: its valid drafts
                drafts[i].cut(proposed)
            sources = (drafts[i].sources(step, accepted, accepted + 1) if hosted else
                       step_sources(step, loop.method, proposed, accepted, accepted + 1))
            m.emitted_tokens += append(s, row[:accepted + 1].tolist(), self.gen.stops,
                                       host_rows(logits, s.slot, accepted + 1, s), sources)
            for name, sec in zip(("propose_s", "score_s", "sample_s"), seconds):
                setattr(s.stats, name, getattr(s.stats, name) + sec / len(streams))
            if s.finished:
                self.release(s)
        if hosted:  # acceptance by source and step costs, to the planner
            hosted.observe(streams, drafts, verified, seconds)
        return verified

    def release(self, s: Stream, keep: bool = True) -> None:
        """Frees s's slot: idle on the device, its rows kept there for a later prompt (keep,
        the prefix cache on: runtime/device/prefill.py), released on the host (its host cache
        rows were never written: the host's prefix cache keeps none of them)."""
        if s.slot is not None:
            loop = self.loop(s)
            loop.state.active[s.slot] = False
            if keep and self.gen.prefix_cache is not None:
                prefill.keep(loop, s)
        self.planner.release(s)
        self.gen.engine.release(s, keep=False)


def slots(streams: list[Stream]) -> set[int]:
    return {s.slot for s in streams}


def host_rows(logits: torch.Tensor, i: int, n: int, s: Stream) -> np.ndarray | None:
    """Row i's first n target rows of logits [B, W, V], [n, V] on the host, where s asks for
    logprobs (append computes them as the host executor does: its numbers); else None."""
    if s.params.logprobs is None:
        return None
    return logits[i, :n].float().cpu().numpy()
