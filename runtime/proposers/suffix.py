"""Suffix lookup across requests (SuffixDecoding-style): n-gram lookup over the stream's own
tokens first, then over the recent outputs of earlier requests, then over the engine's
corpus of answers where it has one.

    propose(stream, k):
        d = ngram_match(prompt + output)                    # as `ngram`
        if len(d) < k: d' = match in the cache of finished requests' tokens, take the longer
        if d matched no more than one token: d'' = the corpus table's chain of its most
            frequent continuations (runtime/corpus.py), taken where it drafts anything
    release(stream): its prompt + output join the cache (bounded: the oldest leave first)

Under the policy's gain rules k is the most a step drafts: each draft is cut to the
length that pays best by the measured acceptance of what found it (the n-gram's length, or
the corpus bin; one position more now and then, so the positions past the cut stay
measured), and a stream drafts nothing where no length pays (probing now and then), as
`auto` judges its lookup.

Templated or repeated workloads (the same questions asked again, documents rewritten) then
draft long runs for free; both lookups read n-gram indexes (ngram_index.py), so a step costs
a few dict reads however much the cache holds.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from trt_spec.runtime.corpus import CorpusTable
from trt_spec.runtime.proposers.base import Drafts, source_key
from trt_spec.runtime.proposers.ngram import NgramProposer, tail
from trt_spec.runtime.proposers.ngram_index import NgramIndex

CACHE_MAX_N = 8  # the longest n-gram the cache indexes (a proposer asking more gets this)
CORPUS_MIN_PROB = 0.3  # a corpus chain stops at a continuation with a smaller share
# corpus drafts are keyed by their first token's share (their acceptance is measured so):
CORPUS_BINS = (0.5, 0.7, 0.9)


def corpus_key(share: float) -> str:
    """"c0" .. "c3": the share bin of a corpus draft's first token."""
    return f"c{sum(share >= b for b in CORPUS_BINS)}"


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

    @property
    def tokens(self) -> int:
        """Tokens held (at most max_tokens)."""
        return self._size

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
    gated = True  # the engine hands it the gate (its DraftLength, batch) to cut drafts by

    def __init__(self, min_n: int = 1, max_n: int = 4,
                 cache: Callable[[], SuffixCache] | None = None,
                 corpus: Callable[[], CorpusTable | None] | None = None,
                 measured: Callable[[], bool] = lambda: False):
        """cache: returns the cache to use (the engine's, shared by its suffix lookups; a
        bench gives each configuration its own); default: a private one. corpus: returns
        the engine's corpus table, or None (none). measured(): whether draft lengths may
        follow measurements (the policy's gain rules are on)."""
        super().__init__(min_n, max_n)
        own = SuffixCache()
        self._cache = cache or (lambda: own)
        self._corpus = corpus or (lambda: None)
        self.measured = measured
        self.skipped: dict[int, int] = {}  # stream id -> its steps where no length paid

    @property
    def cache(self) -> SuffixCache:
        return self._cache()

    def draft(self, s, k: int) -> np.ndarray:
        return self.draft_n(s, k)[0]

    def draft_n(self, s, k: int) -> tuple[np.ndarray, int | str]:
        """(the draft, what found it: the length of the n-gram it continues, 0: no match;
        a corpus chain: corpus_key of its first share)."""
        own, n = self.lookup_n(s, k)
        found = np.asarray(own, dtype=np.int64)
        if len(own) < k and len(self.cache):
            other, m = self.cache.match_n(tail(s, self.max_n), k, max(self.min_n, 2),
                                          self.max_n)
            if len(other) > len(own):
                found, n = other, m
        corpus = self._corpus()
        if corpus is not None and k > 0 and (n < 2 or len(found) < 2):
            # a match of one token (or none) says little; the corpus's phrases say more
            chain, shares = corpus.chain(tail(s, corpus.max_n), k, 2, CORPUS_MIN_PROB)
            if len(chain):
                return chain, corpus_key(shares[0])
        return found, n

    def length(self, s, i: int, key: str, n: int, gate, drafting: int) -> int:
        """How many of n drafts found by `key` to verify: under the gain rules, the best
        length by that key's measured acceptance (none where no length pays, but for
        probes), at a fixed k and at k = auto alike (an adaptive stream's draft is then cut
        by position too, in the engine); else n."""
        if gate is None or not self.measured():
            return n
        rule = gate.rule
        acc = rule.acceptance(source_key(self.name, key), not s.params.greedy)
        best, gain = acc.best(rule.costs, None, n, gate.batch, drafting)
        if gain >= 1:
            return acc.longer(best, n)
        return 0 if gate.skips(self.skipped, s.id, gain) else best

    def propose(self, streams, ks, gate=None):
        found = [self.draft_n(s, k) if k > 0 else (np.zeros(0, dtype=np.int64), 0)
                 for s, k in zip(streams, ks)]
        drafting = sum(1 for k in ks if k > 0)
        tokens = [d[:self.length(s, i, str(n), len(d), gate, drafting)] if len(d) else d
                  for i, (s, (d, n)) in enumerate(zip(streams, found))]
        sources = [self.name if len(t) else None for t in tokens]
        keys = [str(n) if len(t) else None for t, (_, n) in zip(tokens, found)]
        corpus = [isinstance(n, str) and len(t) > 0 for t, (_, n) in zip(tokens, found)]
        return Drafts(tokens, [None] * len(streams), sources, keys, corpus)

    def release(self, s) -> None:
        super().release(s)
        self.skipped.pop(s.id, None)
        self.cache.add(s.prompt_ids + s.output_ids)
