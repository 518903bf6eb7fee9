"""Prompt lookup (draft-free): continue the longest recent n-gram match.

Finds the most recent earlier occurrence of the stream's last n tokens (n from max_n down
to min_n) in its prompt + output, and proposes the k tokens that followed it. No model, no
graph: the cost is a vectorised scan of the token history (RTP-LLM's "deterministic"
proposer, vLLM's `ngram`, transformers' prompt_lookup_num_tokens).
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from trt_spec.runtime.proposers.base import Drafts, Proposer


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


class NgramProposer(Proposer):
    name = "ngram"

    def __init__(self, min_n: int = 1, max_n: int = 4):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"ngram n range {min_n}..{max_n}: need 1 <= min_n <= max_n")
        self.min_n, self.max_n = min_n, max_n

    def propose(self, streams, ks, gate=None):
        tokens = []
        for s, k in zip(streams, ks):
            seq = np.asarray(s.prompt_ids + s.output_ids, dtype=np.int64)
            tokens.append(ngram_match(seq, k, self.min_n, self.max_n) if k > 0 else seq[:0])
        return Drafts(tokens, [None] * len(streams))
