"""The speculation planner: how much each stream drafts this step, and what was learned from
it. The engine calls it three times a step:

    ks     = planner.plan(streams, m)            k per stream (0: a plain row): the policy's
                                                 rules on measured step costs (policy.py),
                                                 probed once per batch size (cost_probe.py)
    drafts = planner.draft(streams, ks)          each method's proposer on its streams, its
                                                 drafts cut by position (`auto`: draft_length.py)
                                                 and to the width the whole step pays best at
                                                 (batch_width.py): one Draft row per stream (a
                                                 draft whose q or confidence is not finite: none)
    planner.observe(streams, drafts, verified)   acceptance by position and by confidence,
                                                 step costs, each stream's gain window

It owns every measurement the plan reads (DraftLength: step costs, acceptance, calibration;
the policy's per-stream windows) and nothing of the streams' tokens or caches.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

from trt_spec.runtime.methods import traits
from trt_spec.runtime.proposers.base import Proposer, source_key
from trt_spec.runtime.settings import SpeculationConfig
from trt_spec.runtime.speculation.batch_width import BatchWidth
from trt_spec.runtime.speculation.cost_cache import CostCache
from trt_spec.runtime.speculation.cost_probe import REPEATS as PROBE_REPEATS, probe_step_costs
from trt_spec.runtime.speculation.draft import GRAMMAR, Draft
from trt_spec.runtime.speculation.draft_length import (DraftLength, PositionAcceptance,
                                                       position_confidence)
from trt_spec.runtime.speculation.policy import SpeculationPolicy

ProposerSource = Callable[[str], "Proposer | None"]  # method -> its proposer (None: none)


def lookup_key(method: str) -> str:
    """The calibration of a method's lookup drafts, by position."""
    return f"{method}/lookup"


def position_key(method: str) -> str:
    """The calibration of a drafter that plans k before drafting (MTP), by position."""
    return f"{method}/position"


@dataclass
class Verified:
    """One stream's outcome of a step: its draft's accepted prefix and the tokens emitted."""

    proposed: int
    accepted: int
    tokens: object  # np.ndarray | list[int]: accepted drafts + the target's own token


@dataclass
class StepTimes:
    """Seconds of one decode step: drafting, the target's forward, sampling and committing."""

    propose_s: float
    score_s: float
    sample_s: float


class SpeculationPlanner:
    def __init__(self, config: SpeculationConfig, max_len: int, target, cache,
                 proposers: ProposerSource, costs: CostCache | None = None):
        """target, cache: what the cost probe times steps on. costs: where step costs measured
        by an earlier process are kept (None: each process probes)."""
        self.policy = SpeculationPolicy(config, max_len)
        self.proposers = proposers
        self.draft_length = DraftLength()  # step costs, acceptance, calibration
        self.plan_s = 0.0  # the last plan's seconds (the cost probe not counted): its step's part
        self.drafted_last: set[int] = set()  # the streams that drafted in the last step
        self.batch_width = BatchWidth()
        self.target, self.cache = target, cache
        self.cost_cache = costs
        self.stored_costs = costs.load() if costs is not None else {}

    @property
    def config(self) -> SpeculationConfig:
        return self.policy.config

    def configure(self, config: SpeculationConfig) -> None:
        """New rules; the measurements stay."""
        self.policy = SpeculationPolicy(config, self.policy.max_len)

    def rules(self) -> DraftLength:
        """The measurements, told the policy's margin and whether measured step times
        correct the c(T) curve (each plan: a bench may swap the DraftLength between its
        configurations)."""
        rule = self.draft_length
        rule.margin = self.config.margin if self.config.fallback else 0.0
        rule.costs.corrected = self.config.measured_costs
        return rule

    def release(self, s) -> None:
        self.policy.release(s)

    def room(self, s) -> int:
        return self.policy.room(s)

    # --- 1. plan ----------------------------------------------------------------------------

    def plan(self, streams: list, m) -> list[int]:
        """Tokens each stream may draft this step (0: a plain row)."""
        self.measure_costs(streams, m)
        t0 = time.perf_counter()
        self.rules()
        drafting = sum(1 for s in streams if s.num_draft_tokens and self.drafts(s))
        ks = self.policy.plan(streams, lambda s, k: self.expected_gain(s, k, len(streams),
                                                                       drafting))
        self.plan_s = time.perf_counter() - t0
        return ks

    def drafts(self, s) -> bool:
        return self.proposers(s.method) is not None

    def probe_widths(self, streams: list) -> range | None:
        """The widths T to time c_B(T) at for this batch, or None where nothing is to probe
        (costs known at this size; no stream drafts a length decided from costs; no room)."""
        if self.draft_length.costs.known(len(streams)):
            return None
        spec = [s for s in streams if s.num_draft_tokens and self.drafts(s)
                and (s.adaptive or self.config.fallback)]
        if not spec:
            return None
        widest = min(max(s.num_draft_tokens for s in spec), min(map(self.room, streams)))
        return range(1, widest + 2) if widest >= 1 else None

    def measure_costs(self, streams: list, m) -> None:
        """The first time this many streams decode with a drafter whose length or fallback
        is decided from costs, time c_B(T) on them (cost_probe.py; m.probe_forwards)."""
        costs = self.draft_length.costs
        widths = self.probe_widths(streams)
        if widths is None:
            return
        batch = len(streams)
        stored = [self.stored_costs.get((batch, t)) for t in widths]
        if all(x is not None for x in stored):  # measured by an earlier process
            for t, seconds in zip(widths, stored):
                costs.record(batch, t, seconds)
            return
        medians = probe_step_costs(self.target, self.cache, streams, widths, costs,
                                   PROBE_REPEATS)
        m.probe_forwards += (PROBE_REPEATS + 1) * len(widths)
        if self.cost_cache is not None:
            self.stored_costs.update({(batch, t): x for t, x in medians.items()})
            self.cost_cache.save(self.stored_costs)

    def acceptance(self, s, key: str | None = None) -> PositionAcceptance:
        """What s's drafts are accepted at, engine-wide, in s's sampling mode: its method's,
        or (key) its source's within it."""
        name = s.method if key is None else source_key(s.method, key)
        return self.draft_length.acceptance(name, not s.params.greedy)

    def expected_gain(self, s, k: int, batch: int, drafting: int) -> tuple[int, float]:
        """(k', gain): the draft length s does best with now, at most k, and the tokens per
        unit of cost it can expect from it, in a batch of `batch` streams of which
        `drafting` may draft. An `auto` stream keeps k (its drafter or the lookup's cut picks
        the length per step). n-gram lookup's acceptance is measured on the steps that found a
        match, so it predicts a match. The suffix cache (and hybrid, which tries it first)
        matches earlier requests too, and a request asked again matches their answers whole,
        which no average predicts: (k, inf) (the per-stream fallback still judges it)."""
        if traits(s.method).picks_length:
            return k, float("inf")
        best, gain = self.acceptance(s).best(self.draft_length.costs, s.method, k, batch,
                                             max(drafting, 1))
        return (k if s.adaptive else best), gain

    # --- 2. draft ---------------------------------------------------------------------------

    def draft(self, streams: list, ks: list[int]) -> list[Draft]:
        """One Draft per stream: each method's proposer called once on its group (a group
        where no stream drafts is a plain step for it; proposers catch up when next asked),
        then every draft cut to the width the step pays best at."""
        drafts = [Draft.none(s.method) for s in streams]
        groups: dict[str, list[int]] = {}
        for i, s in enumerate(streams):
            if self.drafts(s):
                groups.setdefault(s.method, []).append(i)
        for method, idx in groups.items():
            if any(ks[i] for i in idx):
                rows = self.draft_group(method, [streams[i] for i in idx],
                                        [ks[i] for i in idx], len(streams))
                for i, row in zip(idx, rows):
                    drafts[i] = row
        self.cut_to_width(streams, drafts)
        return drafts

    def draft_group(self, method: str, group: list, ks: list[int], batch: int) -> list[Draft]:
        """One proposer call. An `auto` stream's lookup drafts (n-gram, suffix) are cut by
        position (but a proposer's that picks its length, under the gain rules: it cut them
        by the acceptance of what found them, a sharper measure); model drafters stop
        themselves through the gate, or (MTP) plan their length before drafting. Each row
        keeps the confidences its cut is tuned from."""
        proposer = self.proposers(method)
        gate = (self.draft_length.gate(method, [s.adaptive for s in group], batch)
                if proposer.gated else None)
        plans = getattr(proposer, "plans", not proposer.gated) and not traits(method).lookup
        if plans:
            ks = [self.draft_length.plan(position_key(method), method, k, batch)
                  if s.adaptive and k > 0 else k for s, k in zip(group, ks)]
        t0 = time.perf_counter()
        out = proposer.propose(group, ks, gate)
        self.draft_length.costs.observe_draft(method, sum(len(t) for t in out.tokens),
                                              time.perf_counter() - t0)
        rows = [Draft.row(out, j, method) for j in range(len(group))]
        # a proposer that picks its length cut its lookup's drafts by what found them already
        picked = traits(method).picks_length and self.config.fallback
        for j, (s, row) in enumerate(zip(group, rows)):
            if len(row) and traits(row.source).lookup:  # deterministic: cut by position
                key = lookup_key(method)
                row.tokens, conf = self.draft_length.cut(key, row.tokens,
                                                         s.adaptive and not picked, batch)
                row.confidence = (key, conf)
            elif gate is not None and gate.confidences[j]:
                row.confidence = (method, gate.confidences[j])
            elif len(row) and plans:  # planned: calibrated by position
                row.confidence = (position_key(method),
                                  [position_confidence(p) for p in range(len(row))])
            if not row.finite:  # a drafter's NaN (its model's, or the request's controls'):
                row.cut(0)  # no draft, a plain row; the target's own rows judge the stream
        return rows

    def cut_to_width(self, streams: list, drafts: list[Draft]) -> None:
        """Cuts every draft to the width the whole step pays best at (batch_width.py): under
        the gain rules, from 2 streams on (alone, a stream is judged by the policy, and a
        suffix match of a request asked again, which no average predicts, keeps its drafts)."""
        lengths = [len(d) for d in drafts]
        if len(streams) < 2 or max(lengths, default=0) == 0 or any(
                n and not self.policy.judged(s) for s, n in zip(streams, lengths)):
            return
        acc = [self.acceptance(s, d.key) if len(d) else None for s, d in zip(streams, drafts)]
        w = self.batch_width.width(self.draft_length, lengths, acc)
        for d in drafts:
            if len(d) > w:
                d.cut(w)

    # --- 3. observe -------------------------------------------------------------------------

    def observe(self, streams: list, drafts: list[Draft], verified: list[Verified],
                times: StepTimes) -> None:
        """After the step: its costs (what it cost every stream, each waiting for all of it,
        in plain steps from the measured means: smoother than this step's time), then per
        stream its acceptance (by position, by source, by confidence) and its gain window.
        Grammar-forced drafts say nothing of a method's acceptance (nor does a forced run
        after a drafter's tokens: only the drafter's own count)."""
        costs = self.draft_length.costs
        batch, width = len(streams), 1 + max(len(d) for d in drafts)
        costs.observe_step(batch, width, times.score_s)
        step_cost = self.measure_step(streams, drafts, times)
        for s, d, v in zip(streams, drafts, verified):
            if s.error is not None:  # failed this step (Engine.isolated): nothing measured
                continue
            own = min(v.accepted, d.drafted)
            if v.proposed and d.confidence:
                self.draft_length.calib(d.confidence[0]).observe(d.confidence[1], own)
            if d.source == GRAMMAR:
                continue
            if d.drafted:
                self.acceptance(s).observe(d.drafted, own)
                if d.key is not None:  # a proposer that picks among sources (hybrid, auto)
                    self.acceptance(s, d.key).observe(d.drafted, own)
            if not s.finished:  # (a finished stream's window is gone)
                self.policy.observe(s, v.proposed, v.accepted, step_cost)

    def observe_plain(self, score_s: float, around_s: float) -> None:
        """What `observe` records of a plain step of one stream, for one run by the lean
        plain step (runtime/plain_step.py): its forward's seconds and those around it."""
        costs = self.draft_length.costs
        costs.observe_step(1, 1, score_s)
        costs.observe_overhead(1, around_s)
        self.drafted_last = set()

    def measure_step(self, streams: list, drafts: list[Draft], times: StepTimes) -> float:
        """What the step cost every stream (each waits for all of it), in plain steps: its
        whole wall time (plan, drafting, forward, verifying, committing) over a plain step's,
        c_B(1) + o_B (the model's cost while that is not measured; or with measured_costs
        off). A drafter's steady step's time past its drafting against the curve's is kept
        per drafter (StepCosts.observe_measured), a plain step's time around its forward as
        o_B."""
        costs = self.draft_length.costs
        batch, width = len(streams), 1 + max(len(d) for d in drafts)
        around = times.sample_s + self.plan_s
        costs.observe_overhead(batch, around, plain=width == 1)
        model = costs.ratio(width, batch) + sum(
            len(d) * costs.draft_ratio(s.method, batch) for s, d in zip(streams, drafts))
        if width == 1:
            self.drafted_last = set()
            return model
        drafters = {d.source for d in drafts if len(d) and d.source != GRAMMAR}
        ids = {s.id for s, d in zip(streams, drafts) if len(d)}
        steady, self.drafted_last = ids <= self.drafted_last, ids
        # a drafter's steady steps only: the first after sitting out (a probe) also hands a
        # head every row it skipped, a one-off that would price all its steps and keep it off
        if len(drafters) == 1 and steady:  # (several drafters: whose the step was is unknown)
            (source,) = drafters
            costs.observe_measured(source, batch, width, times.score_s + around)
            if traits(source).lookup:  # (what a picking proposer asks a lookup's cost as)
                costs.observe_measured(None, batch, width, times.score_s + around)
        seconds = times.propose_s + times.score_s + around
        unit = costs.plain_seconds(batch)
        if unit is None or not self.config.measured_costs:
            return model
        return seconds / unit
