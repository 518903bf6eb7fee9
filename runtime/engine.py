"""The engine that advances streams (runtime/stream.py) one step at a time.

It keeps no per-stream state (the planner's windows, a proposer's caches: keyed by stream).

    step(streams, max_prefill_tokens):
        prefill(new streams)          one ragged target forward, at most max_prefill_tokens
                                      prompt tokens (a long prompt is read in chunks over
                                      several steps; its first token is sampled after its last;
                                      a request's other choices then fork its prompt's rows)
        decode(the others)            one target forward for every stream, whatever its method

    decode(streams):                  the loop of speculative sampling (Leviathan et al., 2023)
        ks     = planner.plan(streams)                 # k per stream; 0 = a plain decode row
        drafts = planner.draft(streams, ks)            # one Draft row per stream
        scores = scorer.score(streams, drafts)         # ONE target forward: [last, d1..dk]
        step   = verify(drafts, scores)                # accepted prefix + 1 token per stream
        commit(streams, step)                          # append, stop, rewind caches
        planner.observe(streams, drafts, step)         # acceptance and costs, for next plan

Every step therefore runs at most two target forwards (prefill, then decode/verify), however
many methods and draft lengths its streams use. What is one stream's own in a step (its rows
under its controls, its sampling and verification, its commit) runs `isolated`
(runtime/stream_step.py): an error there fails that stream alone; the others go on with the
output they would have had without it. Under a grammar (runtime/guided_step.py) a
forced continuation is drafted for free, drafts are held to what the grammar allows, and the
rows' masks are made while the target runs.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from trt_spec.runtime import guided_step, plain_step
from trt_spec.runtime.backends.base import StepGraph, StepOutput
from trt_spec.runtime.kv_cache import KVCache
from trt_spec.runtime.prefix_cache import PrefixCache
from trt_spec.runtime.proposers.base import Proposer
from trt_spec.runtime.provenance import step_sources
from trt_spec.runtime.sampling import next_token
from trt_spec.runtime.scorer import Scorer
from trt_spec.runtime.settings import SpeculationConfig
from trt_spec.runtime.speculation.cost_cache import CostCache
from trt_spec.runtime.speculation.draft import Draft
from trt_spec.runtime.speculation.planner import (ProposerSource, SpeculationPlanner,
                                                  StepTimes, Verified)
from trt_spec.runtime.step_inputs import SlotTokens
from trt_spec.runtime.stream_step import FAILED, isolated, verify_stream
from trt_spec.runtime.stream import (StepMetrics, StopChecker, Stream, append, cached_tokens,
                                     controlled, count_drafted,
                                     finish_unsampled, prefill_chunks, record_prompt_logprobs)

# one worker for the grammar's masks, made while the target's forward runs (engine.decode)
MASKER = ThreadPoolExecutor(1, thread_name_prefix="trt-spec-masks")


@dataclass
class StepResult:
    """What one decode step verified: per stream its outcome and the logits its logprobs read
    (before the grammar's masks), and the target's rows its proposer reads."""

    verified: list[Verified]
    logits: list[np.ndarray]
    rows: dict[str, list[np.ndarray]]
    drafts: list[Draft]  # what each stream drafted (its tokens' sources: runtime/provenance.py)


class Engine:
    """Propose -> score -> sample -> commit for a batch of streams of any methods."""

    def __init__(self, target: StepGraph, cache: KVCache, stops: StopChecker,
                 speculation: SpeculationConfig, proposers: ProposerSource,
                 prefix: PrefixCache | None = None, costs: CostCache | None = None):
        """speculation: the planner's rules. proposers: a method's proposer, loaded once (the
        Generator's). prefix: the prefix cache admission reads (None: each prompt is read whole).
        costs: where step costs an earlier process measured are kept (None: each process probes)."""
        self.target = target
        self.cache = cache
        self.prefix = prefix
        self.running: dict[int, Stream] = {}  # slot -> the stream admitted into it
        self.stops = stops
        self.proposers = proposers
        self.scorer = Scorer(target, cache)
        self.planner = SpeculationPlanner(speculation, cache.max_len, target, cache, proposers,
                                          costs)

    def proposer(self, s: Stream) -> Proposer | None:
        return self.proposers(s.method)

    def reads(self, streams: list[Stream]) -> tuple[str, ...]:
        """The target outputs the streams' proposers draft from, each once."""
        names = {p.reads for p in map(self.proposer, streams) if p is not None and p.reads}
        return tuple(sorted(names))

    def admit(self, s: Stream, reuse: bool = True, source: Stream | None = None) -> None:
        """Gives s a KV slot: with a prefix cache and `reuse`, the one whose rows its prompt
        starts with (runtime/prefix_cache.py); s's prefill then starts after them. source:
        another choice of the same request (n > 1), running: s starts from its prompt's rows
        once it has read them (`fork`), and reads only the prompt's last token itself."""
        if len(s.prompt_ids) >= self.cache.max_len:
            raise ValueError(f"the prompt has {len(s.prompt_ids)} tokens; this engine's context "
                             f"holds {self.cache.max_len} (prompt + output)")
        p = self.proposer(s)  # a drafter that fails to load fails this request, now
        s.stats.t_added = time.perf_counter()
        if source is not None and source.slot is not None:
            assert source.prompt_ids == s.prompt_ids, "choices of one request share a prompt"
            s.slot = self.cache.allocate() if self.prefix is None else self.prefix.take(None)
            s.fork_of = source
            self.running[s.slot] = s
            if source.prefill_pos == len(source.prompt_ids):
                self.fork(s)
            return
        if self.prefix is None or not reuse:
            s.slot = self.cache.allocate()
        else:
            # a prompt whose logprobs are asked for is read whole: its rows' logits are needed
            hit = self.prefix.find(s.prompt_ids, {slot: (r.id, cached_tokens(r, self.cache))
                                                  for slot, r in self.running.items()}) \
                if s.params.prompt_logprobs is None else None
            s.slot = self.prefix.take(hit)
            n = 0 if hit is None else hit.tokens
            if n and p is not None:
                n = p.adopt(s, hit.slot, n, hit.owner)  # hit.slot: s's own when kept
            self.cache.lengths[s.slot] = s.prefill_pos = s.stats.cached_tokens = n
            self.prefix.record(len(s.prompt_ids), n)
        self.running[s.slot] = s

    def fork(self, s: Stream) -> None:
        """s starts from the rows of its prompt that s.fork_of has read: copied into s's slot,
        all but the last (read again, for s's own first token's logits)."""
        source, n = s.fork_of, len(s.prompt_ids) - 1
        self.cache.copy_rows(source.slot, s.slot, n)
        p = self.proposer(s)
        if n and p is not None:
            n = p.adopt(s, source.slot, n, source.id)
        self.cache.lengths[s.slot] = s.prefill_pos = s.stats.cached_tokens = n
        s.prompt_logprobs = source.prompt_logprobs[:n + 1]  # the rows copied: their logprobs
        s.fork_of = None
        if self.prefix is not None:
            self.prefix.record(len(s.prompt_ids), n)

    def release(self, s: Stream, keep: bool = True) -> None:
        """Frees s's slot; with a prefix cache and `keep`, the slot keeps its valid rows for a
        later prompt that starts with the same tokens."""
        if s.slot is not None:
            for c in self.running.values():  # choices waiting on s read their prompt whole
                if c.fork_of is s:
                    c.fork_of = None
            p = self.proposer(s)
            if p is not None:
                p.release(s)
            self.planner.release(s)
            tokens = cached_tokens(s, self.cache) if keep and self.prefix is not None else None
            self.running.pop(s.slot, None)
            self.cache.release(s.slot, tokens, s.id)
            s.slot = None

    def isolated(self, s: Stream, work, *args):
        """work(*args), s's own part of a step: its error fails s alone (stream_step.py)."""
        return isolated(s, self.release, work, *args)

    def observe(self, s: Stream, start: int, rows: dict[str, list[np.ndarray]], i: int,
                n: int | None = None) -> None:
        """Hands s's proposer its rows (request i of a step, the first n) of the output it
        reads, for positions from `start`."""
        p = self.proposer(s)
        if p is not None and p.reads:
            p.observe(s, start, rows[p.reads][i][:n])

    def step(self, streams: list[Stream], max_prefill_tokens: int | None = None) -> StepMetrics:
        """Prefills new streams (at most max_prefill_tokens prompt tokens in all, in stream
        order; None: every prompt whole), then advances the others by `decode`."""
        assert max_prefill_tokens is None or max_prefill_tokens >= 0, max_prefill_tokens
        t0 = time.perf_counter()
        active = [s for s in streams if not s.finished]
        new = [s for s in active if not s.prefilled and s.fork_of is None]
        old = [s for s in active if s.prefilled]
        chunks = prefill_chunks(new, max_prefill_tokens)
        m = StepMetrics(len(chunks), sum(n for _, n in chunks), len(old))
        if chunks:
            self.prefill(chunks)
            m.target_forwards += 1
        m.prefill_s = time.perf_counter() - t0
        if old:
            self.decode(old, m)
            m.target_forwards += 1
        m.total_s = time.perf_counter() - t0
        return m

    def prefill(self, chunks: list[tuple[Stream, int]]) -> None:
        """One ragged forward over the next n prompt tokens of each (stream, n); a stream
        whose prompt is then all in the cache samples its first token."""
        requests = []
        for s, n in chunks:
            last = s.prefill_pos + n == len(s.prompt_ids)
            # prompt logprobs: the logits of every row, from this same forward
            at = list(range(n)) if s.params.prompt_logprobs is not None else \
                [n - 1] if last else []
            requests.append(SlotTokens(s.slot, s.prompt_ids[s.prefill_pos:s.prefill_pos + n],
                                       at))
        out = self.target.step(self.cache, requests, self.reads([s for s, _ in chunks]))
        for i, ((s, n), logits) in enumerate(zip(chunks, out.logits)):
            self.isolated(s, self.read_chunk, s, n, logits, out.rows, i)

    def read_chunk(self, s: Stream, n: int, logits: np.ndarray,
                   rows: dict[str, list[np.ndarray]], i: int) -> None:
        """After prefill: s read its next n prompt tokens (request i of the forward, logits
        [rows asked, vocab]); after its last, its first token is sampled."""
        start, s.prefill_pos = s.prefill_pos, s.prefill_pos + n
        self.observe(s, start, rows, i)
        if s.params.prompt_logprobs is not None:
            record_prompt_logprobs(s, start, logits)
        if s.prefill_pos < len(s.prompt_ids):
            return  # more chunks to come
        for c in [c for c in self.running.values() if c.fork_of is s]:
            self.fork(c)  # the request's other choices start from these rows
        s.stats.record(0, 0)
        if s.params.max_tokens == 0:  # the prompt only: read, nothing sampled
            finish_unsampled(s)
            self.release(s)
            return
        row = logits[-1:]
        if s.guide is not None:  # the first token under the grammar too
            row = row.copy()
            s.guide.apply(row, s.guide.masks([]))
        token = next_token(controlled(s, row)[0], s.params, 0)
        append(s, [token], self.stops, logits[-1:], step_sources(0, None, 0, 0, 1))
        if s.finished:
            self.release(s)

    def decode(self, streams: list[Stream], m: StepMetrics) -> None:
        """Propose -> score -> sample -> commit, every stream in one target forward."""
        if len(streams) == 1 and plain_step.decode(self, streams[0], m):
            return
        ks = self.planner.plan(streams, m)
        t0 = time.perf_counter()  # (the cost probe, once per batch size, is not this step's)
        forced = guided_step.forced_drafts(streams, ks, self.planner.config.forced_tokens,
                                           self.planner.room)
        drafts = self.planner.draft(streams, ks)
        guided_step.hold_to_grammar(streams, drafts, forced, self.planner)
        t1 = time.perf_counter()
        if plain_step.undrafted(self, streams, m, drafts, t1 - t0):  # a lone plain row: lean
            return
        count_drafted(streams, drafts)
        # the grammar's masks depend only on the drafts: made while the target runs
        masks = (MASKER.submit(guided_step.masks, streams, drafts)
                 if any(s.guide is not None for s in streams) else None)
        scores = self.scorer.score(streams, [d.tokens for d in drafts], self.reads(streams))
        t2 = time.perf_counter()
        raw = (guided_step.apply_masks(streams, masks.result(), scores.logits, m)
               if masks else {})
        step = self.verify(streams, drafts, scores, raw)
        self.commit(streams, step, m)
        t3 = time.perf_counter()
        times = StepTimes(t1 - t0, t2 - t1, t3 - t2)
        self.planner.observe(streams, drafts, step.verified, times)
        for s in streams:  # the step's time, shared out per stream
            s.stats.propose_s += times.propose_s / len(streams)
            s.stats.score_s += times.score_s / len(streams)
            s.stats.sample_s += times.sample_s / len(streams)
        m.propose_s, m.score_s, m.sample_s = times.propose_s, times.score_s, times.sample_s

    def verify(self, streams: list[Stream], drafts: list[Draft], scores: StepOutput,
               raw: dict[int, np.ndarray]) -> StepResult:
        """Each stream's outcome (stream_step.verify_stream), isolated: one that fails is
        FAILED. raw: logits before the grammar's masks, where logprobs report them."""
        verified = [self.isolated(s, verify_stream, s, d, x) or FAILED
                    for s, d, x in zip(streams, drafts, scores.logits)]
        logits = [raw.get(i, x) for i, x in enumerate(scores.logits)]
        return StepResult(verified, logits, scores.rows, drafts)

    def commit(self, streams: list[Stream], step: StepResult, m: StepMetrics) -> None:
        """Appends each stream's emitted tokens and records them; a finished stream frees its
        slot, the others rewind the target's cache to what was accepted and hand their
        proposer the target's rows of the accepted positions."""
        for i, (s, v) in enumerate(zip(streams, step.verified)):
            if s.error is None:  # (failed in verify: released there)
                self.isolated(s, self.commit_one, s, v, step, i, m)

    def commit_one(self, s: Stream, v: Verified, step: StepResult, i: int, m: StepMetrics) -> None:
        """Stream i of the step: its tokens appended and counted, then its slot freed when it
        finished, else its caches rewound and its proposer handed the accepted rows."""
        s.stats.record(v.proposed, v.accepted)
        m.verified(v.proposed, v.accepted)
        sources = step.drafts[i].sources(s.stats.target_forwards - 1, v.accepted, len(v.tokens))
        m.emitted_tokens += append(s, v.tokens, self.stops, step.logits[i], sources)
        if s.finished:
            self.release(s)
            return
        # rows of [last, d1..d_accepted]: positions n-1 .. n-1+accepted
        start = len(s.prompt_ids) + len(s.output_ids) - len(v.tokens) - 1
        self.observe(s, start, step.rows, i, v.accepted + 1)
        self.scorer.rewind(s)
        p = self.proposer(s)
        if p is not None:
            p.commit(s)
