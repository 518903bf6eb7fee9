"""Hybrid: a suffix match where the context repeats, a model drafter everywhere else.

    propose(streams, ks):
        per stream: d = suffix lookup (own tokens, then earlier requests'; runtime/proposers/
            suffix.py); trusted when it drafts at least `min_run` tokens
        trusted streams take d (nearly free to draft, often long); the others draft with the
            head (MTP / Eagle3 / ..., its k and `auto` gate as usual)
        under the policy's gain rules a fixed k is the most either drafts: each takes the
            length that its own measured acceptance within hybrid says pays best, and the
            head none where no length pays (a large batch: probing now and then)

The head keeps its bookkeeping either way (it catches up on the rows it skipped), so each
stream switches per step. Drafts.sources says which proposer drafted each stream's step.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from trt_spec.runtime.proposers.base import Drafts, Proposer, source_key
from trt_spec.runtime.proposers.suffix import SuffixProposer

MIN_RUN = 2  # a lookup that drafts fewer tokens than this is not trusted over the head


class HybridProposer(Proposer):
    name = "hybrid"
    gated = True

    def __init__(self, lookup: SuffixProposer, head: Proposer, min_run: int = MIN_RUN,
                 measured: Callable[[], bool] = lambda: True):
        """measured(): whether draft lengths may follow measurements (the policy's gain rules
        are on)."""
        self.lookup = lookup
        self.head = head
        self.min_run = min_run
        self.measured = measured
        self.reads = head.reads
        self.plans = not head.gated  # `auto`: the engine plans k for a head without a gate
        self.skipped: dict[tuple[int, str], int] = {}  # (stream, source) -> steps not paying

    def length(self, s, i: int, source: str, n: int, gate, drafting: int) -> int:
        """How many of n drafts from `source` to verify: under the gain rules, the best length
        by that source's measured acceptance within hybrid (a lookup matching 4 tokens but
        accepted for 1 is cut to what pays), at a fixed k, and for the lookup at k = auto
        too (the engine leaves its drafts to this cut); else n (an adaptive stream's head
        stops itself through the gate)."""
        if (gate is None or not self.measured()
                or (gate.adaptive[i] and source != self.lookup.name)):
            return n
        rule = gate.rule
        acc = rule.acceptance(source_key(self.name, source), not s.params.greedy)
        cost_of = None if source == self.lookup.name else source
        best, gain = acc.best(rule.costs, cost_of, n, gate.batch, drafting)
        # a lookup drafts for free (the batch width cuts it); a head must beat the margin
        if gain >= 1 + rule.margin or cost_of is None:
            return acc.longer(best, n)
        # no length of the head pays (a large batch, a weak head): it does not draft, as the
        # policy's rule for a single method, with its probes so the measurements go on.
        # (Pooled over match lengths a lookup's acceptance undersells its long matches, which
        # auto tells apart: it is not judged so.)
        return 0 if gate.skips(self.skipped, (s.id, source), gain) else best

    def propose(self, streams, ks, gate=None):
        looked = self.lookup.propose(streams, ks)
        found = looked.tokens
        trusted = [len(d) >= min(self.min_run, k) and len(d) > 0 for d, k in zip(found, ks)]
        drafting = sum(1 for k in ks if k > 0)
        found = [f[:self.length(s, i, self.lookup.name, len(f), gate, drafting)]
                 if t and len(f) else f
                 for i, (s, f, t) in enumerate(zip(streams, found, trusted))]
        head_ks = [0 if t or k == 0 else self.length(s, i, self.head.name, k, gate, drafting)
                   for i, (s, t, k) in enumerate(zip(streams, trusted, ks))]
        drafts = self.head.propose(streams, head_ks, gate if self.head.gated else None)
        tokens = [f if t else d for t, f, d in zip(trusted, found, drafts.tokens)]
        probs = [None if t else q for t, q in zip(trusted, drafts.probs)]
        sources = [(self.lookup.name if t else self.head.name) if len(d) else None
                   for t, d in zip(trusted, tokens)]
        corpus = [t and bool(looked.corpus and looked.corpus[i]) for i, t in enumerate(trusted)]
        return Drafts(tokens, probs, sources, corpus=corpus)

    def observe(self, stream, start: int, rows: np.ndarray) -> None:
        self.head.observe(stream, start, rows)

    def commit(self, stream) -> None:
        self.head.commit(stream)

    def release(self, stream) -> None:
        self.head.release(stream)
        self.lookup.release(stream)
        for source in (self.lookup.name, self.head.name):
            self.skipped.pop((stream.id, source), None)

    def adopt(self, stream, src: int, n: int, owner: int) -> int:
        return min(self.head.adopt(stream, src, n, owner),
                   self.lookup.adopt(stream, src, n, owner))
