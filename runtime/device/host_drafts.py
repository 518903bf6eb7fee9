"""Host drafts on the device executor: the methods whose drafter lives on the host (suffix,
hybrid, auto: the registry's Method.host_drafts, runtime/methods.py) run their step
on the device loop (runtime/device/loop.py) as the other methods do; only the drafting is
the host's.

    before the step (host)    ks     = the policy's plan (k capped by the room left)
                              drafts = the engine's planner over this method's proposer
                                       (its suffix lookup and measured choice, as on the host)
                              upload one [nb, k + 2] int64 table: tokens | length | head
    propose (device)          a row of the lookup takes its uploaded tokens; a row whose
                              source is the model head (hybrid, auto) takes the device head's
                              drafts (runtime/device/drafters.py UploadedDrafts: the methods'
                              device face); slots past a row's length are invalid
    score, sample (device)    the target over [last, d1..dk] and the same verify as every
                              method (runtime/device/verify.py): drafter-invariant, so greedy
                              and seeded output equal the host executor's
    after the step (host)     the planner observes acceptance per source ("auto:<source>",
                              "hybrid:<source>") and the step's costs, as the engine does, so
                              auto's choices follow the workload; a finished stream's tokens
                              join the suffix cache at its release (Engine.release)

The proposer drafting here is the host executor's own (suffix) or a copy of it that shares
its lookup and per-stream state but whose model head is `HeadOnDevice`: a placeholder draft
of the length the host chose, filled on the device. The head therefore runs in every
device step, for every row (its bookkeeping on the device needs every row, and a captured
graph has one shape): picking it costs only its rows' verification, which the step costs
recorded here say (the verify forward has W rows whatever the drafts' lengths).
"""

from __future__ import annotations

import copy
import time

import numpy as np
import torch

from trt_spec.runtime.proposers.base import Drafts, Proposer
from trt_spec.runtime.speculation.draft import Draft
from trt_spec.runtime.speculation.planner import SpeculationPlanner, StepTimes, Verified
from trt_spec.runtime.stream import Stream, count_drafted
from trt_spec.runtime.verify import PLACEHOLDER


class HeadOnDevice(Proposer):
    """A model head that drafts on the device: on the host it answers a proposer's call with
    placeholders of the length asked (the device head fills them), so the proposer's choice
    (its source, its length) is made as on the host."""

    gated = False

    def __init__(self, head: Proposer):
        self.name = head.name

    def propose(self, streams, ks, gate=None):
        return Drafts([np.full(k, PLACEHOLDER, dtype=np.int64) for k in ks],
                      [None] * len(streams))


def host_proposer(p: Proposer) -> Proposer:
    """What drafts a device stream of p's method on the host: p itself where it has no model
    head (suffix); else a copy sharing p's lookup and per-stream state (released with p's, at
    Engine.release) with its head on the device (hybrid, auto)."""
    head = getattr(p, "head", None)
    if head is None:
        return p
    copied = copy.copy(p)
    copied.head, copied.reads = HeadOnDevice(head), None
    return copied


class HostDraftPlanner(SpeculationPlanner):
    """The engine's planner (its policy, acceptance, costs: everything it measures), drafting
    with another proposer source: a method's host_proposer."""

    def __init__(self, base: SpeculationPlanner, proposers):
        self.base, self.proposers = base, proposers

    def __getattr__(self, name: str):
        return getattr(self.base, name)  # (read live: the engine may reconfigure its policy)


class HostDrafts:
    """A host drafter's host side on the device loop: its drafts each step, uploaded into the
    loop's drafter (its device face: runtime/device/drafters.py UploadedDrafts)."""

    def __init__(self, loop, gen, method: str):
        host = gen.proposer(method)
        self.proposer = host_proposer(host)
        self.planner = HostDraftPlanner(gen.engine.planner, lambda _: self.proposer)
        self.head_name = getattr(getattr(host, "head", None), "name", None)
        self.k, self.table = loop.k, loop.drafter.table
        self.draft_s = 0.0  # the host's drafting of the last step (seconds)

    def draft(self, loop, streams: list[Stream]) -> list[Draft]:
        """The host proposer's drafts for this step of `streams`, uploaded."""
        t0 = time.perf_counter()
        p = self.planner
        drafting = sum(1 for s in streams if s.num_draft_tokens)
        ks = p.policy.plan(streams, lambda s, k: p.expected_gain(s, k, len(streams), drafting))
        drafts = p.draft(streams, ks)
        count_drafted(streams, drafts)
        self.upload(loop, streams, drafts)
        self.draft_s = time.perf_counter() - t0
        return drafts

    def upload(self, loop, streams: list[Stream], drafts: list[Draft]) -> None:
        """One host -> device copy of the table's rows [0, nb); other slots: no drafts."""
        k = self.k
        table = np.zeros((max(s.slot for s in streams) + 1, k + 2), dtype=np.int64)
        for s, d in zip(streams, drafts):
            assert len(d) <= k, (len(d), k)
            row = table[s.slot]
            row[k], row[k + 1] = len(d), d.source == self.head_name
            if not row[k + 1]:
                row[:len(d)] = d.tokens
        self.table[:len(table)].copy_(torch.from_numpy(table))

    def observe(self, streams: list[Stream], drafts: list[Draft], verified: list[Verified],
                seconds: list[float]) -> None:
        """After the step: acceptance by source and the step's costs to the planner (as the
        engine's Engine.decode records them); proposers told of each grown output."""
        self.planner.observe(streams, drafts, verified, StepTimes(*seconds))
        for s in streams:
            if not s.finished and s.error is None:
                self.proposer.commit(s)
