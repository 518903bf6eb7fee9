"""Suffix lookup across requests (SuffixDecoding-style): n-gram lookup over the stream's own
tokens first, then over the recent outputs of earlier requests.

    propose(stream, k):
        d = ngram_match(prompt + output)                    # as `ngram`
        if len(d) < k: d' = match in the cache of finished requests' tokens, take the longer
    release(stream): its prompt + output join the cache (bounded: the oldest leave first)

Templated or repeated workloads (the same questions asked again, documents rewritten) then
draft long runs for free; both lookups read n-gram indexes (ngram_index.py), so a step costs
a few dict reads however much the cache holds.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from trt_spec.runtime.proposers.base import Drafts
from trt_spec.runtime.proposers.ngram import NgramProposer, tail
from trt_spec.runtime.proposers.ngram_index import NgramIndex

CACHE_MAX_N = 8  # the longest n-gram the cache indexes (a proposer asking more gets this)


class SuffixCache:
    """The token ids of recent requests, at most `max_tokens` in all (oldest evicted first),
    indexed by their n-grams of 1..max_n tokens (a match never spans two requests)."""

    def __init__(self, max_tokens: int = 1 << 16, max_n: int = CACHE_MAX_N):
        assert max_tokens > 0, max_tokens
        self.max_tokens = max_tokens
        self._index = NgramIndex(1, max_n)
        self._size = 0

    def __len__(self) -> int:
        return len(self._index.lengths)

    def add(self, tokens: list[int]) -> None:
        seq = list(tokens[-self.max_tokens:])
        self._index.extend(seq)
        self._index.end_sequence()
        self._size += len(seq)
        while self._size > self.max_tokens:
            self._size -= self._index.drop_oldest() - 1

    def match(self, context, k: int, min_n: int, max_n: int) -> np.ndarray:
        """Up to k tokens that followed the most recent cached occurrence of the longest
        suffix of `context` (max_n down to min_n tokens), within one request ([0] when
        none matches)."""
        return self.match_n(context, k, min_n, max_n)[0]

    def match_n(self, context, k: int, min_n: int, max_n: int) -> tuple[np.ndarray, int]:
        """(match's tokens, the length of the suffix they continue; 0: none)."""
        run, n = self._index.match_n([int(t) for t in context[-max_n:]], k, min_n, max_n)
        return np.asarray(run, dtype=np.int64), n


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
        return self.draft_n(s, k)[0]

    def draft_n(self, s, k: int) -> tuple[np.ndarray, int]:
        """(the draft, the length of the n-gram it continues; 0: no match)."""
        own, n = self.lookup_n(s, k)
        if len(own) >= k or not len(self.cache):
            return np.asarray(own, dtype=np.int64), n
        other, m = self.cache.match_n(tail(s, self.max_n), k, max(self.min_n, 2), self.max_n)
        return (other, m) if len(other) > len(own) else (np.asarray(own, dtype=np.int64), n)

    def propose(self, streams, ks, gate=None):
        return Drafts([self.draft(s, k) if k > 0 else np.zeros(0, dtype=np.int64)
                       for s, k in zip(streams, ks)], [None] * len(streams))

    def release(self, s) -> None:
        super().release(s)
        self.cache.add(s.prompt_ids + s.output_ids)
