"""Hybrid: a suffix match where the context repeats, a model drafter everywhere else.

    propose(streams, ks):
        per stream: d = suffix lookup (own tokens, then earlier requests'; runtime/proposers/
            suffix.py); trusted when it drafts at least `min_run` tokens
        trusted streams take d (nearly free to draft, often long); the others draft with the
            head (MTP / Eagle3 / ..., its k and `auto` gate as usual)

The head keeps its bookkeeping either way (it catches up on the rows it skipped), so each
stream switches per step. Drafts.sources says which proposer drafted each stream's step.
"""

from __future__ import annotations

import numpy as np

from trt_spec.runtime.proposers.base import Drafts, Proposer
from trt_spec.runtime.proposers.suffix import SuffixProposer

MIN_RUN = 2  # a lookup that drafts fewer tokens than this is not trusted over the head


class HybridProposer(Proposer):
    name = "hybrid"
    gated = True

    def __init__(self, lookup: SuffixProposer, head: Proposer, min_run: int = MIN_RUN):
        self.lookup = lookup
        self.head = head
        self.min_run = min_run
        self.reads = head.reads
        self.plans = not head.gated  # `auto`: the engine plans k for a head without a gate

    def propose(self, streams, ks, gate=None):
        found = self.lookup.propose(streams, ks).tokens
        trusted = [len(d) >= min(self.min_run, k) and len(d) > 0 for d, k in zip(found, ks)]
        drafts = self.head.propose(streams, [0 if t else k for t, k in zip(trusted, ks)],
                                   gate if self.head.gated else None)
        tokens = [f if t else d for t, f, d in zip(trusted, found, drafts.tokens)]
        probs = [None if t else q for t, q in zip(trusted, drafts.probs)]
        sources = [(self.lookup.name if t else self.head.name) if len(d) else None
                   for t, d in zip(trusted, tokens)]
        return Drafts(tokens, probs, sources)

    def observe(self, stream, start: int, rows: np.ndarray) -> None:
        self.head.observe(stream, start, rows)

    def commit(self, stream) -> None:
        self.head.commit(stream)

    def release(self, stream) -> None:
        self.head.release(stream)
        self.lookup.release(stream)

    def adopt(self, stream, src: int, n: int, owner: int) -> int:
        return min(self.head.adopt(stream, src, n, owner),
                   self.lookup.adopt(stream, src, n, owner))
