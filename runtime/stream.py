"""One request's state as the engine advances it: the Stream, its statistics and metrics, and
the rules that append tokens to it (stop conditions) and read its prompt in chunks.

A Stream is one request's state: its tokens, KV-cache slot, sampling state and method; its
statistics are a StreamStats beside it. The engine (runtime/engine.py) keeps no per-stream
state of its own.
"""

from __future__ import annotations

import dataclasses
import itertools
import secrets
import time
from dataclasses import asdict, dataclass, field

import numpy as np

from trt_spec.runtime.kv_cache import KVCache
from trt_spec.runtime.methods import PLAIN
from trt_spec.runtime.provenance import TokenSource
from trt_spec.runtime.sampling import (SamplingParams, TokenLogprob, check_finite,
                                       process_logits, token_logprob, token_logprobs)
from trt_spec.runtime.tokenizer import Tokenizer

_ids = itertools.count()


@dataclass(frozen=True)
class RequestMetrics:
    """One request's statistics, as data (times in seconds)."""

    method: str
    num_draft_tokens: int  # the k asked for (0: method none; adaptive: the most per step)
    adaptive: bool
    prompt_tokens: int
    cached_tokens: int  # prompt tokens not read again: their KV came from the prefix cache
    completion_tokens: int
    time_to_first_token_s: float | None
    decode_s: float
    decode_tokens_per_s: float | None
    target_forwards: int  # prefill included
    tau: float | None  # tokens per target forward, bonus/recovered token included (1.0 = no gain)
    proposed_tokens: int
    accepted_tokens: int
    acceptance_rate: float | None
    acceptance_per_position: tuple[float, ...]
    proposed_per_position: tuple[int, ...]
    accepted_per_position: tuple[int, ...]
    propose_s: float
    score_s: float
    sample_s: float
    drafted_by: dict[str, int]  # steps that drafted, by proposer (hybrid: lookup or head)
    # structured outputs: seconds computing and applying the grammar's masks, and masks made
    mask_s: float = 0.0
    masks: int = 0
    # which executor stepped it (runtime/executors.py): "host" or "device"; fallback: why
    # the host, where the device executor was wanted and does not cover the request yet
    executor: str = "host"
    fallback: str | None = None

    def to_dict(self) -> dict:
        d = asdict(self)
        for name in ("acceptance_per_position", "proposed_per_position", "accepted_per_position"):
            d[name] = list(d[name])
        return d


@dataclass
class StreamStats:
    """What happened to one stream: times (time.perf_counter(), seconds) and counters."""

    t_added: float = 0.0
    t_first_token: float | None = None
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache
    t_finished: float | None = None
    target_forwards: int = 0
    proposed: int = 0
    accepted: int = 0
    proposed_per_position: list[int] = field(default_factory=list)
    accepted_per_position: list[int] = field(default_factory=list)
    propose_s: float = 0.0
    score_s: float = 0.0
    sample_s: float = 0.0
    drafted_by: dict[str, int] = field(default_factory=dict)  # steps each proposer drafted

    def record(self, proposed: int, accepted: int) -> None:
        """One target forward that verified `proposed` drafts and kept `accepted`."""
        self.target_forwards += 1
        self.proposed += proposed
        self.accepted += accepted
        count_positions(self.proposed_per_position, proposed)
        count_positions(self.accepted_per_position, accepted)


@dataclass
class Stream:
    prompt_ids: list[int]
    params: SamplingParams
    method: str = PLAIN
    num_draft_tokens: int = 0  # k drafted per step (0: plain decoding); adaptive: at most k
    adaptive: bool = False  # drafts while a token pays for itself (runtime/speculation/draft_length.py)
    id: int = field(default_factory=lambda: next(_ids))
    output_ids: list[int] = field(default_factory=list)
    slot: int | None = None
    prefill_pos: int = 0  # prompt tokens already in the target's cache (chunked prefill)
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    # finish_reason "error" from an exception in this stream's own part of a step (a row
    # that is not finite, ...: Engine.isolated), which failed it alone; None: none
    error: Exception | None = None
    # an exception raised on this stream's behalf in work its step shares (its grammar's
    # forced tokens, drafts and masks: runtime/guided_step.py), raised again in its own part
    # of the step, so that it fails alone there (stream_step.verify_stream)
    fault: Exception | None = None
    text: str = ""
    # per output token, when params.logprobs is set: its log-probability under the target
    logprobs: list[TokenLogprob] = field(default_factory=list)
    # per prompt token, when params.prompt_logprobs is set: its log-probability given the
    # tokens before it (None for the first), filled chunk by chunk as the prompt is read
    prompt_logprobs: list[TokenLogprob | None] = field(default_factory=list)
    stats: StreamStats = field(default_factory=StreamStats)
    # per output token, where it came from (runtime/provenance.py)
    sources: list[TokenSource] = field(default_factory=list)
    guide: object = None  # runtime/grammar.py Guide: the structure the output is held to
    # another choice of the same request (n > 1) whose prompt rows this one starts from, once
    # it has read them (Engine.fork); None: none, or forked already
    fork_of: "Stream | None" = None
    # the executor that steps it (runtime/executors.py choose, at admission) and, when the
    # device was wanted and the host steps it, why
    executor: str = "host"
    fallback: str | None = None

    def __post_init__(self):
        if not self.prompt_ids:
            raise ValueError("the prompt is empty: at least one token is needed")
        if self.method == PLAIN:
            self.num_draft_tokens, self.adaptive = 0, False
        if self.params.seed is None:  # its own, kept on params: the output reports it
            self.params = dataclasses.replace(self.params, seed=secrets.randbits(64))

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def prefilled(self) -> bool:
        return bool(self.output_ids)

    def metrics(self) -> RequestMetrics:
        st, n = self.stats, len(self.output_ids)
        end = st.t_finished or time.perf_counter()
        ttft = (st.t_first_token - st.t_added) if st.t_first_token else None
        decode_s = (end - st.t_first_token) if st.t_first_token else 0.0
        return RequestMetrics(
            method=self.method, num_draft_tokens=self.num_draft_tokens, adaptive=self.adaptive,
            prompt_tokens=len(self.prompt_ids), cached_tokens=st.cached_tokens,
            completion_tokens=n,
            time_to_first_token_s=ttft, decode_s=decode_s,
            decode_tokens_per_s=(n - 1) / decode_s if n > 1 and decode_s > 0 else None,
            target_forwards=st.target_forwards,
            tau=n / st.target_forwards if st.target_forwards else None,
            proposed_tokens=st.proposed, accepted_tokens=st.accepted,
            acceptance_rate=st.accepted / st.proposed if st.proposed else None,
            acceptance_per_position=tuple(a / p for a, p in zip(st.accepted_per_position,
                                                                st.proposed_per_position)),
            proposed_per_position=tuple(st.proposed_per_position),
            accepted_per_position=tuple(st.accepted_per_position),
            propose_s=st.propose_s, score_s=st.score_s, sample_s=st.sample_s,
            drafted_by=dict(st.drafted_by),
            mask_s=self.guide.mask_s if self.guide is not None else 0.0,
            masks=self.guide.masks_made if self.guide is not None else 0,
            executor=self.executor, fallback=self.fallback)


def count_positions(counts: list[int], n: int) -> None:
    """Adds 1 to counts[0..n-1] (draft positions 1..n), growing the list as needed."""
    if n > len(counts):
        counts += [0] * (n - len(counts))
    for i in range(n):
        counts[i] += 1


@dataclass
class StepMetrics:
    """What one engine step did, returned as data (as RTP-LLM's
    SpeculativeEngineStepMetrics; times in seconds)."""

    prefill_streams: int = 0
    prefill_tokens: int = 0
    decode_streams: int = 0
    speculating_streams: int = 0
    proposed_tokens: int = 0
    accepted_tokens: int = 0
    emitted_tokens: int = 0
    target_forwards: int = 0  # 0, 1 or 2: prefill, then decode/verify
    probe_forwards: int = 0  # timing forwards (cost_probe.py): once per batch size, else 0
    accepted_per_position: list[int] = field(default_factory=list)
    prefill_s: float = 0.0
    propose_s: float = 0.0
    score_s: float = 0.0
    sample_s: float = 0.0
    mask_s: float = 0.0  # structured outputs: the grammar's masks (inside sample_s)
    total_s: float = 0.0
    device_streams: int = 0  # streams the device executor stepped (runtime/executors.py)
    fallbacks: dict[str, int] = field(default_factory=dict)  # admitted to the host: why

    def merge(self, other: "StepMetrics") -> "StepMetrics":
        """Adds another executor's part of the same scheduler step (counts and times)."""
        for f in dataclasses.fields(self):
            a, b = getattr(self, f.name), getattr(other, f.name)
            if isinstance(a, list):
                a += [0] * (len(b) - len(a))
                for i, x in enumerate(b):
                    a[i] += x
            elif isinstance(a, dict):
                for key, x in b.items():
                    a[key] = a.get(key, 0) + x
            else:
                setattr(self, f.name, a + b)
        return self

    def verified(self, proposed: int, accepted: int) -> None:
        """Counts one stream's verification: `proposed` drafts, `accepted` of them."""
        self.speculating_streams += proposed > 0
        self.proposed_tokens += proposed
        self.accepted_tokens += accepted
        count_positions(self.accepted_per_position, accepted)


class StopChecker:
    """EOS, stop token ids, stop strings, max_tokens and cache capacity."""

    def __init__(self, tokenizer: Tokenizer, eos_ids: set[int], max_len: int):
        self.tokenizer = tokenizer
        self.eos_ids = eos_ids
        self.max_len = max_len

    def update(self, s: Stream) -> None:
        token = s.output_ids[-1]
        p = s.params
        early = len(s.output_ids) < p.min_tokens  # nothing stops it yet (vLLM's min_tokens)
        if not early and ((token in self.eos_ids and not p.ignore_eos)
                          or token in p.stop_token_ids):
            s.finish_reason = "stop"
        elif s.guide is not None and s.guide.done:  # the structure is complete
            s.finish_reason = "stop"
        elif p.stop and not early:
            s.text = self.decode(s.output_ids, p)
            end = stop_end(s.text, p.stop, self.floor(s), p.include_stop_str_in_output)
            if end is not None:
                s.text = s.text[:end]
                s.finish_reason = "stop"
        if s.finish_reason is None and len(s.output_ids) >= p.max_tokens:
            s.finish_reason = "length"
        # the next step writes the last token at row len(prompt) + len(output) - 1
        if s.finish_reason is None and len(s.prompt_ids) + len(s.output_ids) > self.max_len:
            s.finish_reason = "length"
        if s.finished:
            s.stats.t_finished = time.perf_counter()
            if not p.stop:
                s.text = self.decode(s.output_ids, p)

    def decode(self, ids: list[int], p: SamplingParams) -> str:
        """The text of ids, special tokens dropped unless p keeps them."""
        return self.tokenizer.decode(ids) if p.skip_special_tokens else \
            self.tokenizer.decode(ids, False)

    def floor(self, s: Stream) -> int:
        """Where a stop string may end at the earliest: past the text of the first
        min_tokens - 1 tokens (0 without min_tokens)."""
        n = s.params.min_tokens
        return len(self.decode(s.output_ids[:n - 1], s.params)) + 1 if n > 1 else 0


def stop_end(text: str, stops: tuple[str, ...], floor: int, include: bool) -> int | None:
    """Where text ends at its first stop string ending at `floor` or later: where the stop
    string starts, or (include) where it ends; None where none is in it."""
    found = [(i, len(x)) for x in stops
             if (i := text.find(x, max(0, floor - len(x)))) >= 0]
    if not found:
        return None
    at, size = min(found)
    return at + size if include else at


def append(s: Stream, tokens, stops: "StopChecker", logits: np.ndarray,
           sources: list[TokenSource]) -> int:
    """Appends tokens one by one until a stop condition holds; returns how many were kept.
    logits: [len(tokens), vocab], the target's logits each token was chosen from (for
    logprobs: a token accepted from a draft is scored by the target's row that verified it).
    sources: each token's origin (runtime/provenance.py), kept with it."""
    for n, token in enumerate(tokens, 1):
        s.output_ids.append(int(token))
        s.sources.append(sources[n - 1])
        if s.guide is not None and not s.guide.consume(token):
            s.finish_reason = "error"  # a grammar no token can go on with
            s.text = stops.decode(s.output_ids, s.params)
            s.stats.t_finished = time.perf_counter()
            return n
        if s.params.logprobs is not None:
            s.logprobs.append(token_logprob(logits[n - 1], int(token), s.params.logprobs))
        if s.stats.t_first_token is None:
            s.stats.t_first_token = time.perf_counter()
        stops.update(s)
        if s.finished:
            return n
    return len(tokens)


def record_prompt_logprobs(s: Stream, start: int, logits: np.ndarray) -> None:
    """Prompt logprobs from a prefill chunk's logits: logits [n, vocab] at positions start ..
    start+n-1, each predicting the token after it (the chunk's last row, at the prompt's last
    token, predicts the first output token: not a prompt token's)."""
    prompt, n = s.prompt_ids, s.params.prompt_logprobs
    if start == 0:
        s.prompt_logprobs = [None]
    assert len(s.prompt_logprobs) == start + 1, (len(s.prompt_logprobs), start)
    rows = logits[:len(prompt) - 1 - start]
    s.prompt_logprobs += token_logprobs(rows, prompt[start + 1:start + 1 + len(rows)], n)


def finish_unsampled(s: Stream) -> None:
    """A stream of max_tokens 0, its prompt read: finished with no new token ("length")."""
    s.finish_reason = "length"
    s.stats.t_finished = time.perf_counter()


def fail(s: Stream, error: Exception) -> None:
    """s ends with finish_reason "error" because of `error`, raised by its own part of a step
    (Engine.isolated frees its slot)."""
    s.error = error
    s.finish_reason = "error"
    s.stats.t_finished = s.stats.t_finished or time.perf_counter()


def controlled(s: Stream, logits: np.ndarray, drafts=()) -> np.ndarray:
    """The target's rows for s, logits [R, vocab] over [last, d1..d(R-1)] (R = 1: the next
    token), after its logits controls (runtime/sampling.py process_logits: row j counts the
    output so far and drafts[:j]); `logits` itself when it uses none. NonFiniteError where a
    row holds NaN or +inf (the model's, or a control's overflow): caught here, where it
    arises, so that the stream alone fails (runtime/engine.py isolated)."""
    z = process_logits(logits, s.params, s.prompt_ids, s.output_ids, drafts)
    return check_finite(z, "the target's logits under the request's sampling controls")


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


def cached_tokens(s: Stream, cache: KVCache) -> list[int]:
    """The token ids of s's valid cache rows. After a verification the rows of rejected drafts
    may still count in the length until the rewind; the last emitted token has no row yet."""
    seq = s.prompt_ids + s.output_ids
    return seq[:min(int(cache.lengths[s.slot]), max(len(seq) - 1, s.prefill_pos))]


def count_drafted(streams: list[Stream], drafts: list) -> None:
    """Per stream, the steps that drafted, by who drafted (hybrid: lookup or head; grammar)."""
    for s, d in zip(streams, drafts):
        if len(d):
            s.stats.drafted_by[d.source] = s.stats.drafted_by.get(d.source, 0) + 1
