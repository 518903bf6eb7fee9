"""Suffix lookup across requests (SuffixDecoding-style): n-gram lookup over the stream's own
tokens first, then over the recent outputs of earlier requests.

    propose(stream, k):
        d = ngram_match(prompt + output)                    # as `ngram`
        if len(d) < k: d' = match in the cache of finished requests' tokens, take the longer
    release(stream): its prompt + output join the cache (bounded: the oldest leave first)

Templated or repeated workloads (the same questions asked again, documents rewritten) then
draft long runs for free; unrelated ones cost a vectorised scan of the cache.
"""

from __future__ import annotations

from collections import deque
from typing import Callable

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from trt_spec.runtime.proposers.base import Drafts
from trt_spec.runtime.proposers.ngram import NgramProposer, ngram_match

SEPARATOR = -1  # between cached sequences: no match runs across two requests


class SuffixCache:
    """The token ids of recent requests, at most `max_tokens` in all (oldest evicted first)."""

    def __init__(self, max_tokens: int = 1 << 16):
        assert max_tokens > 0, max_tokens
        self.max_tokens = max_tokens
        self._seqs: deque[np.ndarray] = deque()
        self._size = 0
        self._flat: np.ndarray | None = None  # the sequences joined by SEPARATOR, built lazily

    def __len__(self) -> int:
        return len(self._seqs)

    def add(self, tokens: list[int]) -> None:
        seq = np.asarray(tokens[-self.max_tokens:], dtype=np.int64)
        self._seqs.append(seq)
        self._size += len(seq)
        while self._size > self.max_tokens:
            self._size -= len(self._seqs.popleft())
        self._flat = None

    def flat(self) -> np.ndarray:
        if self._flat is None:
            parts = []
            for s in self._seqs:
                parts += [s, np.array([SEPARATOR])]
            self._flat = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
        return self._flat

    def match(self, context: np.ndarray, k: int, min_n: int, max_n: int) -> np.ndarray:
        """Up to k tokens that followed the most recent cached occurrence of the longest
        suffix of `context` (max_n down to min_n tokens) ([0] when none matches)."""
        flat = self.flat()
        for n in range(min(max_n, len(context)), min_n - 1, -1):
            if len(flat) <= n:
                continue
            windows = sliding_window_view(flat[:-1], n)  # every cached n-gram with a successor
            hits = np.nonzero((windows == context[-n:]).all(axis=1))[0]
            if hits.size:
                start = int(hits[-1]) + n
                run = flat[start:start + k]
                stop = np.nonzero(run == SEPARATOR)[0]
                return run[:stop[0]] if stop.size else run
        return context[:0]


class SuffixProposer(NgramProposer):
    name = "suffix"

    def __init__(self, min_n: int = 1, max_n: int = 4,
                 cache: Callable[[], SuffixCache] | None = None):
        """cache: returns the cache to use (the engine's, shared by its suffix lookups; a
        bench gives each configuration its own); default: a private one."""
        super().__init__(min_n, max_n)
        own = SuffixCache()
        self._cache = cache or (lambda: own)

    @property
    def cache(self) -> SuffixCache:
        return self._cache()

    def draft(self, s, k: int) -> np.ndarray:
        seq = np.asarray(s.prompt_ids + s.output_ids, dtype=np.int64)
        own = ngram_match(seq, k, self.min_n, self.max_n)
        if len(own) >= k or not len(self.cache):
            return own
        other = self.cache.match(seq, k, max(self.min_n, 2), self.max_n)
        return other if len(other) > len(own) else own

    def propose(self, streams, ks, gate=None):
        return Drafts([self.draft(s, k) if k > 0 else np.zeros(0, dtype=np.int64)
                       for s, k in zip(streams, ks)], [None] * len(streams))

    def release(self, s) -> None:
        self.cache.add(s.prompt_ids + s.output_ids)
