"""Streams and the plain (non-speculative) engine.

A Stream carries everything about one generation that must survive between steps: its
tokens, its KV-cache slot, its sampling state. Engines hold no per-stream state, so a stream
can move between engines between steps.

    step(streams):                              # NormalEngine
        prefill each new stream (one ragged batch), sample its first token
        decode every other stream: its last token, one batched forward, sample
        check stop conditions; free the slots of finished streams
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field

import numpy as np

from trt_spec.runtime.backends.ort import OrtTarget
from trt_spec.runtime.kv_cache import KVCache
from trt_spec.runtime.sampling import SamplingParams, next_token
from trt_spec.runtime.step_inputs import Request
from trt_spec.runtime.tokenizer import Tokenizer

_ids = itertools.count()


@dataclass
class Stream:
    prompt_ids: list[int]
    params: SamplingParams
    id: int = field(default_factory=lambda: next(_ids))
    output_ids: list[int] = field(default_factory=list)
    slot: int | None = None
    finish_reason: str | None = None  # "stop" | "length"
    text: str = ""
    rng: np.random.Generator = None
    # timings (time.perf_counter())
    t_added: float = 0.0
    t_first_token: float | None = None
    t_finished: float | None = None

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
        }


@dataclass
class StepMetrics:
    """What one engine step did, returned as data (the CLI prints it)."""

    prefill_streams: int = 0
    prefill_tokens: int = 0
    decode_streams: int = 0
    seconds: float = 0.0


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


class NormalEngine:
    """One target forward per generated token, every active stream batched."""

    def __init__(self, target: OrtTarget, cache: KVCache, stops: StopChecker):
        self.target = target
        self.cache = cache
        self.stops = stops

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

    def step(self, streams: list[Stream]) -> StepMetrics:
        t0 = time.perf_counter()
        active = [s for s in streams if not s.finished]
        new = [s for s in active if not s.prefilled]
        old = [s for s in active if s.prefilled]
        m = StepMetrics(len(new), sum(len(s.prompt_ids) for s in new), len(old))
        for group, requests in (
            (new, [Request(s.slot, s.prompt_ids, [len(s.prompt_ids) - 1]) for s in new]),
            (old, [Request(s.slot, [s.output_ids[-1]], [0]) for s in old]),
        ):
            if not group:
                continue
            out = self.target.step(self.cache, requests)
            for s, logits in zip(group, out.logits):
                s.output_ids.append(next_token(logits[-1], s.params, s.rng))
                if s.t_first_token is None:
                    s.t_first_token = time.perf_counter()
                self.stops.update(s)
                if s.finished:
                    self.release(s)
        m.seconds = time.perf_counter() - t0
        return m
