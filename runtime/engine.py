"""Streams and the engines that advance them.

A Stream carries everything about one generation that must survive between steps: its
tokens, its KV-cache slot, its sampling state, its counters. Engines keep no per-stream state
(a proposer's draft cache is keyed by slot and checked against the stream), so a stream can
move between NormalEngine and SpeculativeEngine between steps.

    step(streams, max_prefill_tokens):          # both engines
        prefill new streams (one ragged batch), at most max_prefill_tokens prompt tokens:
            a long prompt is read in chunks over several steps (chunked prefill), so the
            streams already decoding keep their pace; its first token is sampled after its
            last chunk
        decode(the others)
        (stop conditions are checked per appended token; finished streams free their slot)

    decode(streams):                            # NormalEngine
        last token of each, one batched forward, sample

    decode(streams):                            # SpeculativeEngine
        ks     = policy.draft_tokens(stream)                 # 0 = plain decode this step
        drafts = proposer.propose(streams, ks)               # [k_i] tokens (+ q when sampling)
        scores = scorer.score(streams, drafts)               # target over [last, d1..dk]
        result = verify_batch(drafts, scores)                # accepted prefix + 1 token
        commit(streams, result)                              # append, stop, rewind caches
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field

import numpy as np

from trt_spec.runtime.backends.ort import OrtTarget
from trt_spec.runtime.kv_cache import KVCache
from trt_spec.runtime.policy import SpeculationPolicy
from trt_spec.runtime.proposers.base import Proposer
from trt_spec.runtime.verify import verify_batch
from trt_spec.runtime.sampling import SamplingParams, TokenLogprob, next_token, token_logprob
from trt_spec.runtime.scorer import Scorer
from trt_spec.runtime.step_inputs import SlotTokens
from trt_spec.runtime.tokenizer import Tokenizer

_ids = itertools.count()


@dataclass
class Stream:
    prompt_ids: list[int]
    params: SamplingParams
    id: int = field(default_factory=lambda: next(_ids))
    output_ids: list[int] = field(default_factory=list)
    slot: int | None = None
    prefill_pos: int = 0  # prompt tokens already in the target's cache (chunked prefill)
    finish_reason: str | None = None  # "stop" | "length"
    text: str = ""
    rng: np.random.Generator = None
    speculate: bool = True  # the request allows speculation (RTP-LLM's force_disable_sp_run)
    # timings (time.perf_counter())
    t_added: float = 0.0
    t_first_token: float | None = None
    t_finished: float | None = None
    # counters: target forwards (prefill included) and speculative totals
    target_forwards: int = 0
    proposed: int = 0
    accepted: int = 0
    proposed_per_position: list[int] = field(default_factory=list)
    accepted_per_position: list[int] = field(default_factory=list)
    propose_s: float = 0.0
    score_s: float = 0.0
    sample_s: float = 0.0
    # speculation policy state (see runtime/policy.py)
    spec_window: list[tuple[int, int]] = field(default_factory=list)
    spec_cooldown: int = 0
    # per output token, when params.logprobs is set: its log-probability under the target
    logprobs: list[TokenLogprob] = field(default_factory=list)

    def __post_init__(self):
        if not self.prompt_ids:
            raise ValueError("the prompt is empty: at least one token is needed")
        if self.rng is None:
            self.rng = np.random.default_rng(self.params.seed)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def prefilled(self) -> bool:
        return bool(self.output_ids)

    def metrics(self) -> dict:
        n = len(self.output_ids)
        end = self.t_finished or time.perf_counter()
        ttft = (self.t_first_token - self.t_added) if self.t_first_token else None
        decode_s = (end - self.t_first_token) if self.t_first_token else 0.0
        return {
            "prompt_tokens": len(self.prompt_ids),
            "completion_tokens": n,
            "time_to_first_token_s": ttft,
            "decode_s": decode_s,
            "decode_tokens_per_s": (n - 1) / decode_s if n > 1 and decode_s > 0 else None,
            "target_forwards": self.target_forwards,
            # tau: tokens per target forward, bonus/recovered token included (1.0 = no gain)
            "tau": n / self.target_forwards if self.target_forwards else None,
            "proposed_tokens": self.proposed,
            "accepted_tokens": self.accepted,
            "acceptance_rate": self.accepted / self.proposed if self.proposed else None,
            "acceptance_per_position": [a / p for a, p in zip(self.accepted_per_position,
                                                              self.proposed_per_position)],
            "propose_s": self.propose_s,
            "score_s": self.score_s,
            "sample_s": self.sample_s,
        }

    def record(self, proposed: int, accepted: int) -> None:
        self.target_forwards += 1
        self.proposed += proposed
        self.accepted += accepted
        count_positions(self.proposed_per_position, proposed)
        count_positions(self.accepted_per_position, accepted)


def count_positions(counts: list[int], n: int) -> None:
    """Adds 1 to counts[0..n-1] (draft positions 1..n), growing the list as needed."""
    if n > len(counts):
        counts += [0] * (n - len(counts))
    for i in range(n):
        counts[i] += 1


@dataclass
class StepMetrics:
    """What one engine step did, returned as data (as RTP-LLM's
    SpeculativeEngineStepMetrics; times in microseconds)."""

    prefill_streams: int = 0
    prefill_tokens: int = 0
    decode_streams: int = 0
    speculating_streams: int = 0
    proposed_tokens: int = 0
    accepted_tokens: int = 0
    emitted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    prefill_us: float = 0.0
    propose_us: float = 0.0
    score_us: float = 0.0
    sample_us: float = 0.0
    total_us: float = 0.0


class StopChecker:
    """EOS, stop token ids, stop strings, max_tokens and cache capacity."""

    def __init__(self, tokenizer: Tokenizer, eos_ids: set[int], max_len: int):
        self.tokenizer = tokenizer
        self.eos_ids = eos_ids
        self.max_len = max_len

    def update(self, s: Stream) -> None:
        token = s.output_ids[-1]
        p = s.params
        if (token in self.eos_ids and not p.ignore_eos) or token in p.stop_token_ids:
            s.finish_reason = "stop"
        elif p.stop:
            s.text = self.tokenizer.decode(s.output_ids)
            cut = min((i for i in (s.text.find(x) for x in p.stop) if i >= 0), default=-1)
            if cut >= 0:
                s.text = s.text[:cut]
                s.finish_reason = "stop"
        if s.finish_reason is None and len(s.output_ids) >= p.max_tokens:
            s.finish_reason = "length"
        # the next step writes the last token at row len(prompt) + len(output) - 1
        if s.finish_reason is None and len(s.prompt_ids) + len(s.output_ids) > self.max_len:
            s.finish_reason = "length"
        if s.finished:
            s.t_finished = time.perf_counter()
            if not p.stop:
                s.text = self.tokenizer.decode(s.output_ids)


def append(s: Stream, tokens, stops: "StopChecker", logits: np.ndarray) -> int:
    """Appends tokens one by one until a stop condition holds; returns how many were kept.
    logits: [len(tokens), vocab], the target's logits each token was chosen from (for
    logprobs: a token accepted from a draft is scored by the target's row that verified it)."""
    for n, token in enumerate(tokens, 1):
        s.output_ids.append(int(token))
        if s.params.logprobs is not None:
            s.logprobs.append(token_logprob(logits[n - 1], int(token), s.params.logprobs))
        if s.t_first_token is None:
            s.t_first_token = time.perf_counter()
        stops.update(s)
        if s.finished:
            return n
    return len(tokens)


def prefill_chunks(new: list[Stream], budget: int | None) -> list[tuple[Stream, int]]:
    """(stream, prompt tokens to read this step) for the streams not yet prefilled, in order,
    within `budget` tokens in all (None: no bound)."""
    chunks = []
    for s in new:
        n = len(s.prompt_ids) - s.prefill_pos
        if budget is not None:
            n = min(n, budget)
            budget -= n
        if n <= 0:
            break
        chunks.append((s, n))
    return chunks


class NormalEngine:
    """One target forward per generated token, every active stream batched."""

    reads: str | None = None  # a target output the engine hands to `observe` (see proposers)

    def __init__(self, target: OrtTarget, cache: KVCache, stops: StopChecker):
        self.target = target
        self.cache = cache
        self.stops = stops

    def observe(self, s: Stream, start: int, rows) -> None:
        """Rows of the target's `reads` output for positions [start, start + len(rows))."""

    def admit(self, s: Stream) -> None:
        if len(s.prompt_ids) >= self.cache.max_len:
            raise ValueError(f"the prompt has {len(s.prompt_ids)} tokens; this engine's context "
                             f"holds {self.cache.max_len} (prompt + output)")
        s.slot = self.cache.allocate()
        s.t_added = time.perf_counter()

    def release(self, s: Stream) -> None:
        if s.slot is not None:
            self.cache.release(s.slot)
            s.slot = None

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
        m.prefill_us = 1e6 * (time.perf_counter() - t0)
        if old:
            self.decode(old, m)
        m.total_us = 1e6 * (time.perf_counter() - t0)
        return m

    def prefill(self, chunks: list[tuple[Stream, int]]) -> None:
        """One ragged forward over the next n prompt tokens of each (stream, n); a stream
        whose prompt is then all in the cache samples its first token."""
        requests = []
        for s, n in chunks:
            last = s.prefill_pos + n == len(s.prompt_ids)
            requests.append(SlotTokens(s.slot, s.prompt_ids[s.prefill_pos:s.prefill_pos + n],
                                    [n - 1] if last else []))
        out = self.target.step(self.cache, requests, (self.reads,) if self.reads else ())
        for i, ((s, n), logits) in enumerate(zip(chunks, out.logits)):
            start, s.prefill_pos = s.prefill_pos, s.prefill_pos + n
            if self.reads:
                self.observe(s, start, out.rows[self.reads][i])
            if s.prefill_pos < len(s.prompt_ids):
                continue  # more chunks to come
            s.record(0, 0)
            append(s, [next_token(logits[-1], s.params, s.rng)], self.stops, logits[-1:])
            if s.finished:
                self.release(s)

    def decode(self, streams: list[Stream], m: StepMetrics) -> None:
        """One token per stream: the last token in, one batched forward, sample."""
        t0 = time.perf_counter()
        out = self.target.step(self.cache, [SlotTokens(s.slot, [s.output_ids[-1]], [0]) for s in streams])
        t1 = time.perf_counter()
        for s, logits in zip(streams, out.logits):
            s.record(0, 0)
            s.score_s += (t1 - t0) / len(streams)
            m.emitted_tokens += append(s, [next_token(logits[-1], s.params, s.rng)], self.stops,
                                       logits[-1:])
            if s.finished:
                self.release(s)
        m.score_us = 1e6 * (t1 - t0)


class SpeculativeEngine(NormalEngine):
    """Propose -> score -> sample -> commit; the proposer is chosen once, at construction."""

    def __init__(self, target: OrtTarget, cache: KVCache, stops: StopChecker,
                 proposer: Proposer, policy: SpeculationPolicy):
        super().__init__(target, cache, stops)
        self.proposer = proposer
        self.policy = policy
        self.scorer = Scorer(target, cache)
        self.reads = proposer.reads

    def observe(self, s: Stream, start: int, rows) -> None:
        self.proposer.observe(s, start, rows)

    def release(self, s: Stream) -> None:
        if s.slot is not None:
            self.proposer.release(s)
        super().release(s)

    def decode(self, streams: list[Stream], m: StepMetrics) -> None:
        """Propose -> score -> sample -> commit, every stream in one target forward."""
        t0 = time.perf_counter()
        ks = [self.policy.draft_tokens(s, len(streams)) for s in streams]
        drafts = self.proposer.propose(streams, ks)
        t1 = time.perf_counter()
        scores = self.scorer.score(streams, drafts.tokens, self.reads)
        t2 = time.perf_counter()
        result = verify_batch(drafts.tokens, drafts.probs, scores.logits,
                              [s.params for s in streams], [s.rng for s in streams])
        self.commit(streams, drafts, result, scores, m)
        t3 = time.perf_counter()
        n = len(streams)
        for s in streams:  # the step's time, shared out per stream
            s.propose_s += (t1 - t0) / n
            s.score_s += (t2 - t1) / n
            s.sample_s += (t3 - t2) / n
        m.propose_us, m.score_us, m.sample_us = 1e6 * (t1 - t0), 1e6 * (t2 - t1), 1e6 * (t3 - t2)

    def commit(self, streams: list[Stream], drafts, result, scores, m: StepMetrics) -> None:
        """Appends the emitted tokens, rewinds both caches to what was accepted, records, and
        hands the proposer the target's rows for the accepted positions."""
        for i, s in enumerate(streams):
            proposed, accepted = len(drafts.tokens[i]), int(result.num_accepted[i])
            emitted = result.tokens[i, :result.num_emitted[i]]
            s.record(proposed, accepted)
            self.policy.observe(s, proposed, accepted)
            m.speculating_streams += proposed > 0
            m.proposed_tokens += proposed
            m.accepted_tokens += accepted
            count_positions(m.accepted_per_position, accepted)
            m.emitted_tokens += append(s, emitted, self.stops, scores.logits[i])
            if s.finished:
                self.release(s)
                continue
            if self.reads:  # rows of [last, d1..d_accepted]: positions n-1 .. n-1+accepted
                start = len(s.prompt_ids) + len(s.output_ids) - len(emitted) - 1
                self.observe(s, start, scores.rows[self.reads][i][:accepted + 1])
            self.scorer.rewind(s)
            self.proposer.commit(s)
