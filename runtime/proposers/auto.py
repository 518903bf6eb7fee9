"""Auto: per stream and step, the drafter that is measured to pay most here, or none.

    propose(streams, ks, gate):
        per stream: d = suffix lookup (its own tokens, then earlier requests'), free to draft
            lookup  j <= len(d) drafts:  (1 + sum of the lookup's acceptance by position)
                                         / c_B(j + 1)
            head    j <= k drafts:       (1 + sum of the head's acceptance by position)
                                         / (c_B(j + 1) + j * its drafting cost)
            the better of the two at its best j; plain (no drafts) where neither beats 1, a
            plain step's tokens per unit of cost (one such step in PROBE_EVERY still drafts
            its best j, and one in PROBE_EVERY that drafts fewer than it could drafts j + 1,
            so the measurements follow the workload)

Acceptance is measured per source within this method (the engine records each step under
"auto:<source>", a lookup's by the length of the n-gram it matched, "auto:suffix/<n>":
draft_length.DraftLength.acceptance) and costs at the batch size decoding
(c_B(T): cost_probe.py, live steps), so the choice differs per batch size and per stream: a
repeating context takes the lookup, free prose the head, a large batch plain steps. The head
is the folder's first of mtp, eagle3, eagle, vanilla (none: lookup or plain); it keeps its
bookkeeping on every step, so a stream switches freely. Drafts.sources says which drafted.
"""

from __future__ import annotations

import time
from typing import Callable

import numpy as np

from trt_spec.runtime.proposers.base import Drafts, Proposer, source_key
from trt_spec.runtime.proposers.hybrid import MIN_RUN
from trt_spec.runtime.proposers.suffix import SuffixProposer

PROBE_EVERY = 16  # of a stream's steps where nothing pays, one in this many drafts anyway


class AutoProposer(Proposer):
    name = "auto"
    gated = True  # the engine's gate carries what the choice reads: its DraftLength, batch

    def __init__(self, lookup: SuffixProposer, head: Proposer | None,
                 measured: Callable[[], bool] = lambda: True, min_run: int = MIN_RUN):
        """measured(): whether the choice may follow measurements (the policy's gain rules
        are on); where not, the choice is hybrid's fixed rule: the lookup when it drafts at
        least `min_run` tokens, else the head at k."""
        self.lookup = lookup
        self.head = head
        self.measured = measured
        self.min_run = min_run
        self.reads = head.reads if head is not None else None
        self.skipped: dict[int, int] = {}  # stream id -> its steps where nothing paid
        self.shortened: dict[int, int] = {}  # ... and its steps drafting less than it could

    def lookup_key(self, n: int | str) -> str:
        """A lookup's acceptance is measured by the length of the n-gram it matched: a run
        found by the last 4 tokens is accepted far more often than one found by the last 1
        (a corpus chain's by the share of its first token: suffix.corpus_key)."""
        return f"{self.lookup.name}/{n}"

    def choose(self, s, found: np.ndarray, k: int, gate, drafting: int, n: int | str = 1
               ) -> tuple[str | None, int]:
        """(source, drafts) for one stream: ("suffix", j), (head name, j) or (None, 0).
        found: the lookup's draft, continuing an n-gram of n tokens."""
        if not self.measured():
            if len(found) >= min(self.min_run, k) or self.head is None:
                return (self.lookup.name, len(found)) if len(found) else (None, 0)
            return self.head.name, k
        rule, batch = gate.rule, gate.batch
        sampled = not s.params.greedy
        options = []
        if len(found):
            acc = rule.acceptance(source_key(self.name, self.lookup_key(n)), sampled)
            j, gain = acc.best(rule.costs, None, len(found), batch, drafting)
            options.append((gain, self.lookup.name, j))
        if self.head is not None:
            acc = rule.acceptance(source_key(self.name, self.head.name), sampled)
            j, gain = acc.best(rule.costs, self.head.name, k, batch, drafting)
            options.append((gain, self.head.name, j))
        if not options:
            return None, 0
        gain, source, j = max(options)
        if gain < 1 + (rule.margin if source != self.lookup.name else 0.0):
            if gate.skips(self.skipped, s.id, gain):  # the first such step of a request
                return None, 0  # probes too, at the best length (policy.py: probes)
        elif j < (len(found) if source == self.lookup.name else k):
            n = self.shortened[s.id] = self.shortened.get(s.id, 0) + 1
            if n % PROBE_EVERY == 0:  # ... and one position more, so that it stays measured
                j += 1
        return source, j

    def propose(self, streams, ks, gate=None):
        assert gate is not None, "the engine hands a gated proposer its gate"
        looked = [self.lookup.draft_n(s, k) if k > 0 else (np.zeros(0, dtype=np.int64), 0)
                  for s, k in zip(streams, ks)]
        found = [f for f, _ in looked]
        drafting = sum(1 for k in ks if k > 0)
        choices = [self.choose(s, f, k, gate, drafting, n) if k > 0 else (None, 0)
                   for s, (f, n), k in zip(streams, looked, ks)]
        tokens = [f[:j] if src == self.lookup.name else np.zeros(0, dtype=np.int64)
                  for f, (src, j) in zip(found, choices)]
        probs: list = [None] * len(streams)
        if self.head is not None:
            head_ks = [j if src == self.head.name else 0 for src, j in choices]
            if any(head_ks):
                t0 = time.perf_counter()
                d = self.head.propose(streams, head_ks, gate if self.head.gated else None)
                drafted = sum(len(t) for t in d.tokens)
                gate.rule.costs.observe_draft(self.head.name, drafted, time.perf_counter() - t0)
                for i, hk in enumerate(head_ks):
                    if hk:
                        tokens[i], probs[i] = d.tokens[i], d.probs[i]
        sources = [src if len(t) else None for t, (src, _) in zip(tokens, choices)]
        keys = [self.lookup_key(n) if src == self.lookup.name else src
                for src, (_, n) in zip(sources, looked)]
        corpus = [src == self.lookup.name and isinstance(n, str)
                  for src, (_, n) in zip(sources, looked)]
        return Drafts(tokens, probs, sources, keys, corpus)

    def observe(self, stream, start: int, rows: np.ndarray) -> None:
        if self.head is not None:
            self.head.observe(stream, start, rows)

    def commit(self, stream) -> None:
        if self.head is not None:
            self.head.commit(stream)

    def release(self, stream) -> None:
        self.skipped.pop(stream.id, None)
        self.shortened.pop(stream.id, None)
        if self.head is not None:
            self.head.release(stream)
        self.lookup.release(stream)

    def adopt(self, stream, src: int, n: int, owner: int) -> int:
        own = self.lookup.adopt(stream, src, n, owner)
        return own if self.head is None else min(own, self.head.adopt(stream, src, n, owner))
