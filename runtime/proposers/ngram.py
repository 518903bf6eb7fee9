"""Prompt lookup (draft-free): continue the longest recent n-gram match.

Finds the most recent earlier occurrence of the stream's last n tokens (n from max_n down
to min_n) in its prompt + output, and proposes the k tokens that followed it. No model, no
graph: each slot keeps an index of its stream's n-grams, grown by the tokens each step adds
(ngram_index.py), so a lookup is a few dict reads (RTP-LLM's "deterministic" proposer, vLLM's
`ngram`, transformers' prompt_lookup_num_tokens). `ngram_match`, a scan of the whole
history, is the reference it is tested against.
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from trt_spec.runtime.proposers.base import Drafts, Proposer
from trt_spec.runtime.proposers.ngram_index import NgramIndex


def ngram_match(tokens: np.ndarray, k: int, min_n: int, max_n: int) -> np.ndarray:
    """tokens: [length] -> up to k proposed tokens ([0] when nothing matches)."""
    length = len(tokens)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        windows = sliding_window_view(tokens[:-1], n)  # (length - n, n): all earlier n-grams
        hits = np.nonzero((windows == tokens[-n:]).all(axis=1))[0]
        if hits.size:
            start = int(hits[-1]) + n  # the most recent match; what followed it
            return tokens[start:start + k]
    return tokens[:0]


def tail(s, n: int) -> list[int]:
    """The last n tokens of the stream's prompt + output."""
    out = s.output_ids[-n:]
    return out if len(out) >= n else s.prompt_ids[len(out) - n:] + out


class NgramProposer(Proposer):
    name = "ngram"

    def __init__(self, min_n: int = 1, max_n: int = 4):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"ngram n range {min_n}..{max_n}: need 1 <= min_n <= max_n")
        self.min_n, self.max_n = min_n, max_n
        self._own: dict[int, tuple[int, NgramIndex]] = {}  # slot -> (stream id, its index)

    def index(self, s) -> NgramIndex:
        """The stream's own n-gram index, grown to its tokens so far."""
        held = self._own.get(s.slot)
        if held is None or held[0] != s.id:
            held = self._own[s.slot] = (s.id, NgramIndex(self.min_n, self.max_n))
        index, known, prompt = held[1], len(held[1]), len(s.prompt_ids)
        if known < prompt:
            index.extend(s.prompt_ids[known:])
            known = prompt
        index.extend(s.output_ids[known - prompt:])
        return index

    def lookup(self, s, k: int) -> list[int]:
        """Up to k tokens continuing the stream's most recent matching n-gram."""
        return self.index(s).match(tail(s, self.max_n), k)

    def lookup_n(self, s, k: int) -> tuple[list[int], int]:
        """(lookup's tokens, the length of the n-gram they continue; 0: none)."""
        return self.index(s).match_n(tail(s, self.max_n), k)

    def propose(self, streams, ks, gate=None):
        return Drafts([np.asarray(self.lookup(s, k) if k > 0 else [], dtype=np.int64)
                       for s, k in zip(streams, ks)], [None] * len(streams))

    def release(self, s) -> None:
        held = self._own.get(s.slot)
        if held is not None and held[0] == s.id:
            del self._own[s.slot]
