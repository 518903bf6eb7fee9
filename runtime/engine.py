"""The engine that advances streams (runtime/stream.py) one step at a time.

The engine keeps no per-stream state of its own (the policy keeps its window, a proposer its
draft cache, each keyed by the stream).

    step(streams, max_prefill_tokens):
        prefill(new streams)          one ragged target forward, at most max_prefill_tokens
                                      prompt tokens (a long prompt is read in chunks over
                                      several steps; its first token is sampled after its last)
        decode(the others)            one target forward for every stream, whatever its method

    decode(streams):
        ks     = policy.plan(streams)                       # 0 = a plain decode row
        drafts = proposer(method).propose(group, ks)        # per method group
        scores = scorer.score(streams, drafts)              # ONE target forward: [last, d1..dk]
        result = verify_batch(drafts, scores)               # accepted prefix + 1 token
        commit(streams, result)                             # append, stop, rewind caches

Every step therefore runs at most two target forwards (prefill, then decode/verify), however
many methods and draft lengths its streams use.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

import numpy as np

from trt_spec.runtime.backends.base import StepGraph
from trt_spec.runtime.speculation.batch_width import BatchWidth
from trt_spec.runtime.speculation.cost_cache import CostCache
from trt_spec.runtime.speculation.cost_probe import REPEATS as PROBE_REPEATS, probe_step_costs
from trt_spec.runtime.speculation.draft_length import DraftLength, PositionAcceptance, position_confidence
from trt_spec.runtime.kv_cache import KVCache
from trt_spec.runtime.methods import traits
from trt_spec.runtime.speculation.policy import SpeculationPolicy
from trt_spec.runtime.prefix_cache import PrefixCache
from trt_spec.runtime.proposers.base import Drafts, Proposer, source_key
from trt_spec.runtime.sampling import next_token
from trt_spec.runtime.scorer import Scorer
from trt_spec.runtime.step_inputs import SlotTokens
from trt_spec.runtime.stream import (StepMetrics, StopChecker, Stream, append, cached_tokens,
                                     count_positions, prefill_chunks)
from trt_spec.runtime.verify import verify_batch


def lookup_key(method: str) -> str:
    """The calibration of a method's lookup drafts, by position."""
    return f"{method}/lookup"


def position_key(method: str) -> str:
    """The calibration of a drafter that plans k before drafting (MTP), by position."""
    return f"{method}/position"
ProposerSource = Callable[[str], "Proposer | None"]
# one worker for the grammar's masks, made while the target's forward runs (engine.decode)
MASKER = ThreadPoolExecutor(1, thread_name_prefix="trt-spec-masks")  # method -> its proposer (None: none)


class Engine:
    """Propose -> score -> sample -> commit for a batch of streams of any methods."""

    def __init__(self, target: StepGraph, cache: KVCache, stops: StopChecker,
                 policy: SpeculationPolicy, proposers: ProposerSource,
                 prefix: PrefixCache | None = None, costs: CostCache | None = None):
        """proposers: the proposer of a method, loaded once (the Generator's). prefix: the
        prefix cache admission reads (None: every prompt is read whole). costs: where step
        costs measured by an earlier process are kept (None: each process probes)."""
        self.target = target
        self.cache = cache
        self.prefix = prefix
        self.running: dict[int, Stream] = {}  # slot -> the stream admitted into it
        self.stops = stops
        self.policy = policy
        self.proposers = proposers
        self.scorer = Scorer(target, cache)
        self.draft_length = DraftLength()  # `auto` k: measured costs and calibration
        self.batch_width = BatchWidth()  # the step's width, judged with the drafts in hand
        self.cost_cache = costs
        self.stored_costs = costs.load() if costs is not None else {}

    def proposer(self, s: Stream) -> Proposer | None:
        return self.proposers(s.method)

    def reads(self, streams: list[Stream]) -> tuple[str, ...]:
        """The target outputs the streams' proposers draft from, each once."""
        names = {p.reads for p in map(self.proposer, streams) if p is not None and p.reads}
        return tuple(sorted(names))

    def admit(self, s: Stream, reuse: bool = True) -> None:
        """Gives s a KV slot: with a prefix cache and `reuse`, the one whose rows its prompt
        starts with (runtime/prefix_cache.py); s's prefill then starts after them."""
        if len(s.prompt_ids) >= self.cache.max_len:
            raise ValueError(f"the prompt has {len(s.prompt_ids)} tokens; this engine's context "
                             f"holds {self.cache.max_len} (prompt + output)")
        p = self.proposer(s)  # a drafter that fails to load fails this request, now
        s.stats.t_added = time.perf_counter()
        if self.prefix is None or not reuse:
            s.slot = self.cache.allocate()
        else:
            hit = self.prefix.find(s.prompt_ids, {slot: (r.id, cached_tokens(r, self.cache))
                                                  for slot, r in self.running.items()})
            s.slot = self.prefix.take(hit)
            n = 0 if hit is None else hit.tokens
            if n and p is not None:
                n = p.adopt(s, hit.slot, n, hit.owner)  # hit.slot: s's own when kept
            self.cache.lengths[s.slot] = s.prefill_pos = s.stats.cached_tokens = n
            self.prefix.record(len(s.prompt_ids), n)
        self.running[s.slot] = s

    def release(self, s: Stream, keep: bool = True) -> None:
        """Frees s's slot; with a prefix cache and `keep`, the slot keeps its valid rows for a
        later prompt that starts with the same tokens."""
        if s.slot is not None:
            p = self.proposer(s)
            if p is not None:
                p.release(s)
            self.policy.release(s)
            tokens = cached_tokens(s, self.cache) if keep and self.prefix is not None else None
            self.running.pop(s.slot, None)
            self.cache.release(s.slot, tokens, s.id)
            s.slot = None

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
        new = [s for s in active if not s.prefilled]
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
            requests.append(SlotTokens(s.slot, s.prompt_ids[s.prefill_pos:s.prefill_pos + n],
                                       [n - 1] if last else []))
        out = self.target.step(self.cache, requests, self.reads([s for s, _ in chunks]))
        for i, ((s, n), logits) in enumerate(zip(chunks, out.logits)):
            start, s.prefill_pos = s.prefill_pos, s.prefill_pos + n
            self.observe(s, start, out.rows, i)
            if s.prefill_pos < len(s.prompt_ids):
                continue  # more chunks to come
            s.stats.record(0, 0)
            row = logits[-1:]
            if s.guide is not None:  # the first token under the grammar too
                row = row.copy()
                s.guide.apply(row, s.guide.masks([]))
            append(s, [next_token(row[0], s.params, s.rng)], self.stops, logits[-1:])
            if s.finished:
                self.release(s)

    def propose(self, streams: list[Stream], ks: list[int]
                ) -> tuple[Drafts, list[tuple[str, list[float]] | None]]:
        """Drafts for every stream, each method's proposer called once on its group; and per
        stream (calibration key, the confidences of its drafts), None where there are none.
        An `auto` stream's lookup drafts (n-gram, suffix) are cut by position
        (DraftLength.cut); model drafters stop themselves through the gate."""
        tokens = [np.zeros(0, dtype=np.int64) for _ in streams]
        probs: list[np.ndarray | None] = [None] * len(streams)
        sources: list[str | None] = [None] * len(streams)  # a picking proposer's choice
        keys: list[str | None] = [None] * len(streams)  # ... and what it is measured under
        confidences: list[tuple[str, list[float]] | None] = [None] * len(streams)
        groups: dict[str, list[int]] = {}
        for i, s in enumerate(streams):
            if self.proposer(s) is not None:
                groups.setdefault(s.method, []).append(i)
        for method, idx in groups.items():
            if not any(ks[i] for i in idx):  # none of the group drafts: a plain step for it
                continue  # (proposers catch up on what they skipped when next asked)
            proposer = self.proposers(method)
            gate = (self.draft_length.gate(method, [streams[i].adaptive for i in idx],
                                           len(streams))
                    if proposer.gated else None)
            kk = [ks[i] for i in idx]
            plans = getattr(proposer, "plans", not proposer.gated) and not traits(method).lookup
            if plans:
                kk = [self.draft_length.plan(position_key(method), method, k, len(streams))
                      if streams[i].adaptive and k > 0 else k for i, k in zip(idx, kk)]
            t0 = time.perf_counter()
            d = proposer.propose([streams[i] for i in idx], kk, gate)
            self.draft_length.costs.observe_draft(method, sum(len(t) for t in d.tokens),
                                                  time.perf_counter() - t0)
            for j, i in enumerate(idx):
                tokens[i], probs[i] = d.tokens[j], d.probs[j]
                by = d.sources[j] if d.sources else method
                if d.sources:
                    sources[i] = d.sources[j]
                    keys[i] = d.keys[j] if d.keys else d.sources[j]
                if len(tokens[i]) and traits(by).lookup:
                    # a lookup's draft: deterministic, cut by position when adaptive
                    key = lookup_key(method)
                    tokens[i], conf = self.draft_length.cut(key, tokens[i], streams[i].adaptive,
                                                            len(streams))
                    confidences[i] = (key, conf)
                elif gate is not None and gate.confidences[j]:
                    confidences[i] = (method, gate.confidences[j])
                elif len(tokens[i]) and plans:  # planned: calibrate by position
                    confidences[i] = (position_key(method),
                                      [position_confidence(p) for p in range(len(tokens[i]))])
                if len(tokens[i]):
                    streams[i].stats.drafted_by[by] = streams[i].stats.drafted_by.get(by, 0) + 1
        return Drafts(tokens, probs, sources, keys), confidences

    def measure_costs(self, streams: list[Stream], m: StepMetrics) -> None:
        """The first time this many streams decode with a drafter whose length or fallback
        is decided from costs, time c_B(T) on them (cost_probe.py; m.probe_forwards)."""
        costs = self.draft_length.costs
        if costs.known(len(streams)):
            return
        spec = [s for s in streams if s.num_draft_tokens and self.proposer(s) is not None
                and (s.adaptive or self.policy.config.fallback)]
        if not spec:
            return
        widest = min(max(s.num_draft_tokens for s in spec),
                     min(self.policy.room(s) for s in streams))
        if widest >= 1:
            batch, widths = len(streams), range(1, widest + 2)
            stored = [self.stored_costs.get((batch, t)) for t in widths]
            if all(x is not None for x in stored):  # measured by an earlier process
                for t, seconds in zip(widths, stored):
                    costs.record(batch, t, seconds)
                return
            medians = probe_step_costs(self.target, self.cache, streams, widths, costs,
                                       PROBE_REPEATS)
            m.probe_forwards += (PROBE_REPEATS + 1) * len(widths)
            if self.cost_cache is not None:
                self.stored_costs.update({(batch, t): x for t, x in medians.items()})
                self.cost_cache.save(self.stored_costs)

    def acceptance(self, s: Stream) -> PositionAcceptance:
        """What s's method has been accepted at, engine-wide, in s's sampling mode."""
        return self.draft_length.acceptance(s.method, s.params.temperature > 0)

    def expected_gain(self, s: Stream, k: int, batch: int, drafting: int) -> tuple[int, float]:
        """(k', gain): the draft length s does best with now, at most k, and the tokens per
        unit of cost it can expect from it, in a batch of `batch` streams of which
        `drafting` may draft. An `auto` stream keeps k (its drafter or the lookup's cut picks
        the length per step). n-gram lookup's acceptance is measured on the steps that found a
        match, so it predicts a match. The suffix cache (and hybrid, which tries it first)
        matches earlier requests too, and a request asked again matches their answers whole,
        which no average predicts: (k, inf) (the per-stream fallback still judges it)."""
        if traits(s.method).picks_length:
            return k, float("inf")
        best, gain = self.acceptance(s).best(self.draft_length.costs, s.method, k, batch,
                                             max(drafting, 1))
        return (k if s.adaptive else best), gain

    def draft_acceptance(self, s: Stream, key: str | None) -> PositionAcceptance:
        """What s's drafts are accepted at: its method's, or its source's within it."""
        if key is None:
            return self.acceptance(s)
        return self.draft_length.acceptance(source_key(s.method, key), s.params.temperature > 0)

    def cut_to_width(self, streams: list[Stream], drafts: Drafts, confidences) -> None:
        """Cuts every stream's drafts to the width the whole step pays best at
        (runtime/speculation/batch_width.py); under the gain rules, from 2 streams on (alone, a stream is
        judged by the policy, and a suffix match of a request asked again, which no average
        predicts, keeps its drafts)."""
        lengths = [len(d) for d in drafts.tokens]
        if len(streams) < 2 or max(lengths, default=0) == 0 or any(
                n and not self.policy.judged(s) for s, n in zip(streams, lengths)):
            return
        keys = drafts.keys or [None] * len(streams)
        acc = [self.draft_acceptance(s, key) if n else None
               for s, n, key in zip(streams, lengths, keys)]
        w = self.batch_width.width(self.draft_length, lengths, acc)
        for i, n in enumerate(lengths):
            if n > w:
                if w == 0:  # a plain step after all: not counted as drafted
                    by = (drafts.sources[i] if drafts.sources else None) or streams[i].method
                    streams[i].stats.drafted_by[by] -= 1
                drafts.tokens[i] = drafts.tokens[i][:w]
                if drafts.probs[i] is not None:
                    drafts.probs[i] = drafts.probs[i][:w]
                if confidences[i]:
                    confidences[i] = (confidences[i][0], confidences[i][1][:w])

    def decode(self, streams: list[Stream], m: StepMetrics) -> None:
        """Propose -> score -> sample -> commit, every stream in one target forward."""
        self.measure_costs(streams, m)
        t0 = time.perf_counter()  # (the probe, once per batch size, is not this step's cost)
        drafting = sum(1 for s in streams if s.num_draft_tokens and self.proposer(s) is not None)
        ks = self.policy.plan(streams, lambda s, k: self.expected_gain(s, k, len(streams),
                                                                       drafting))
        forced = self.forced_drafts(streams, ks)  # grammar-forced tokens: no drafter runs
        drafts, confidences = self.propose(streams, ks)
        self.cut_to_width(streams, drafts, confidences)
        self.hold_to_grammar(streams, drafts, confidences, forced)
        t1 = time.perf_counter()
        # the grammar's masks depend only on the drafts: made while the target runs
        masks = (MASKER.submit(self.masks, streams, drafts)
                 if any(s.guide is not None for s in streams) else None)
        scores = self.scorer.score(streams, drafts.tokens, self.reads(streams))
        t2 = time.perf_counter()
        rows = 1 + max(len(d) for d in drafts.tokens)  # the step's widest request
        self.draft_length.costs.observe_step(len(streams), rows, t2 - t1)
        raw = self.mask(streams, masks.result(), scores.logits, m) if masks else {}
        # streams that drafted: verified; the others take the target's next token as plain
        # decoding does (the same draw from the same distribution as verifying no drafts)
        spec = [i for i in range(len(streams)) if len(drafts.tokens[i])]
        result = verify_batch([drafts.tokens[i] for i in spec], [drafts.probs[i] for i in spec],
                              [scores.logits[i] for i in spec],
                              [streams[i].params for i in spec], [streams[i].rng for i in spec])
        emitted: list[tuple[int, np.ndarray]] = []  # per stream: (accepted, tokens)
        row = dict(zip(spec, range(len(spec))))
        for i, s in enumerate(streams):
            if i in row:
                r = row[i]
                emitted.append((int(result.num_accepted[r]),
                                result.tokens[r, :result.num_emitted[r]]))
                if confidences[i]:  # acceptance by confidence: what `auto` k is tuned from
                    key, conf = confidences[i]
                    self.draft_length.calib(key).observe(conf, emitted[-1][0])
            else:  # method none: the target's next token, as plain decoding samples it
                emitted.append((0, [next_token(scores.logits[i][-1], s.params, s.rng)]))
        self.commit(streams, drafts, emitted, scores, rows, m, set(forced), raw)
        t3 = time.perf_counter()
        self.draft_length.costs.observe_overhead(len(streams), t3 - t2)
        n = len(streams)
        for s in streams:  # the step's time, shared out per stream
            s.stats.propose_s += (t1 - t0) / n
            s.stats.score_s += (t2 - t1) / n
            s.stats.sample_s += (t3 - t2) / n
        m.propose_s, m.score_s, m.sample_s = t1 - t0, t2 - t1, t3 - t2

    def forced_drafts(self, streams: list[Stream], ks: list[int]) -> dict[int, np.ndarray]:
        """Per stream under a grammar that allows exactly one continuation from here: those
        tokens (at most SpeculationConfig.forced_tokens), drafted for free; its own drafter
        sits this step out (ks[i] = 0)."""
        limit = self.policy.config.forced_tokens
        forced = {}
        for i, s in enumerate(streams):
            if s.guide is not None and limit:
                room = min(limit, self.policy.room(s))
                tokens = s.guide.forced(room)
                tokens = tokens[:s.guide.valid(tokens)]  # as the mask allows them
                if tokens:
                    forced[i] = np.asarray(tokens, dtype=np.int64)
                    ks[i] = 0
        return forced

    def hold_to_grammar(self, streams: list[Stream], drafts: Drafts, confidences,
                        forced: dict[int, np.ndarray]) -> None:
        """Forced tokens become their streams' drafts; a drafter's drafts are cut where the
        grammar stops allowing them. A sampled draft with a distribution keeps its first
        disallowed token: verification rejects it for certain and samples that position from
        the residual max(0, p - q), which keeps the output distribution exact (cutting it would
        sample from p instead)."""
        for i, s in enumerate(streams):
            if s.guide is None:
                continue
            if i in forced:
                drafts.tokens[i], drafts.probs[i], confidences[i] = forced[i], None, None
                s.stats.drafted_by["grammar"] = s.stats.drafted_by.get("grammar", 0) + 1
                continue
            tokens = drafts.tokens[i]
            n = s.guide.valid(tokens)
            if n == len(tokens):
                continue
            if drafts.probs[i] is not None and not s.params.greedy:
                n += 1
            drafts.tokens[i] = tokens[:n]
            if drafts.probs[i] is not None:
                drafts.probs[i] = drafts.probs[i][:n]
            if confidences[i]:
                confidences[i] = (confidences[i][0], confidences[i][1][:n])
            if n == 0:  # nothing left to verify: a plain step, not counted as drafted
                by = (drafts.sources[i] if drafts.sources else None) or s.method
                s.stats.drafted_by[by] -= 1

    @staticmethod
    def masks(streams: list[Stream], drafts: Drafts) -> dict[int, np.ndarray]:
        """Per guided stream, its grammar's bitmasks for the rows it verifies: before each
        allowed draft and after the last (all of its drafts, or all but a kept rejected one).
        llguidance drops the GIL, so this runs beside the target's forward."""
        out = {}
        for i, s in enumerate(streams):
            if s.guide is not None:
                tokens = drafts.tokens[i]
                out[i] = s.guide.masks(tokens[:s.guide.valid(tokens)])
        return out

    def mask(self, streams: list[Stream], masks: dict[int, np.ndarray],
             logits: list[np.ndarray], m: StepMetrics) -> dict[int, np.ndarray]:
        """Masks, in place, each guided stream's rows of logits by its bitmasks. Returns the
        logits as they were for the streams that report logprobs."""
        raw = {}
        for i, bits in masks.items():
            guide = streams[i].guide
            before = guide.mask_s
            if streams[i].params.logprobs is not None:
                raw[i] = logits[i].copy()
            guide.apply(logits[i], bits)
            m.mask_s += guide.mask_s - before
        return raw

    def commit(self, streams: list[Stream], drafts: Drafts, emitted, scores, rows: int,
               m: StepMetrics, free: set[int] = frozenset(), raw: dict | None = None) -> None:
        """Appends the emitted tokens, rewinds both caches to what was accepted, records, and
        hands each proposer the target's rows for the accepted positions. rows: the widest
        request of the step (what its cost is measured by). free: streams whose drafts the
        grammar forced (their acceptance says nothing of their method's). raw: logits before
        the grammar's masks, where logprobs report them."""
        costs = self.draft_length.costs
        # what the step cost every stream (each waits for all of it), in plain steps, from the
        # measured means (smoother than this one step's time)
        batch = len(streams)
        step_cost = costs.ratio(rows, batch) + sum(
            len(d) * costs.draft_ratio(s.method, batch) for s, d in zip(streams, drafts.tokens))
        for i, (s, (accepted, tokens)) in enumerate(zip(streams, emitted)):
            proposed = len(drafts.tokens[i])
            s.stats.record(proposed, accepted)
            if proposed and i not in free:  # (forced drafts say nothing of the method's)
                self.acceptance(s).observe(proposed, accepted)
                by = drafts.keys[i] if drafts.keys else None
                if by is not None:  # a proposer that picks among sources (hybrid, auto)
                    self.draft_length.acceptance(source_key(s.method, by),
                                                 s.params.temperature > 0).observe(proposed,
                                                                                   accepted)
            if i not in free:
                self.policy.observe(s, proposed, accepted, step_cost)
            m.speculating_streams += proposed > 0
            m.proposed_tokens += proposed
            m.accepted_tokens += accepted
            count_positions(m.accepted_per_position, accepted)
            logits = raw[i] if raw and i in raw else scores.logits[i]
            m.emitted_tokens += append(s, tokens, self.stops, logits)
            if s.finished:
                self.release(s)
                continue
            # rows of [last, d1..d_accepted]: positions n-1 .. n-1+accepted
            start = len(s.prompt_ids) + len(s.output_ids) - len(tokens) - 1
            self.observe(s, start, scores.rows, i, accepted + 1)
            self.scorer.rewind(s)
            p = self.proposer(s)
            if p is not None:
                p.commit(s)
