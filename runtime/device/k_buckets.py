"""k per step on the device: the host's planner decides, the device loop runs a k bucket.

A DeviceLoop (runtime/device/loop.py) serves one method, at most k_max drafts a step. Each
step the host plans as for the host executor (runtime/speculation/planner.py `plan`: the
policy's rules, min_acceptance, spec_max_batch and the gain rules, and `auto` k's length),
and the loop runs it so:

    ks      = planner.plan(streams, m)          # k per stream (0: a plain row), on the host,
                                                # cut to the step's width (batch_width.py)
    kb      = bucket(max ks, k_max)             # one of a few shapes: 1, 2, 4, k_max
    cap     = ks by slot                        # state.cap [slots]: a row drafts at most its k
    loop.step(nb)                               # propose kb, score, verify: drafts past a
                                                # row's cap are invalid (rejected, unverified)
    planner.observe(streams, drafts, verified)  # acceptance by position, step costs c_B(T)

So streams of different k share one loop and one step, and a CUDA graph is captured per
(nb, bucket) only: a handful of shapes, not one per k. A loop with a drafter runs at least
bucket 1 even when every row plans 0 (its drafter's catch-up keeps its caches current, as
the host's proposers catch up when next asked); the capped rows then verify no draft.

The device keeps a planner of its own (`DevicePlanner`): the same records the host's feeds
(DraftLength: step costs, acceptance by position per method and sampling mode; the policy's
windows per stream), filled from the device's own steps, since a step of T rows costs on the
device what the device's forward costs (under exact decoding every verify forward is W rows,
so c_B(T) is flat there and drafting is what a token costs). Its cost probe times the
device's score phase (`probe`) instead of the host target's step.

Sampled output is unchanged by any of it: a token is the race of the stream's seed at its
output position (runtime/race.py), whatever was drafted; greedy output under exact decoding is
plain decoding's for any k below EXACT_ROWS.
"""

from __future__ import annotations

import statistics
import time

import numpy as np
import torch

from trt_spec.runtime.methods import METHODS, traits
from trt_spec.runtime.speculation.cost_probe import REPEATS
from trt_spec.runtime.speculation.draft import Draft
from trt_spec.runtime.speculation.planner import SpeculationPlanner, StepTimes, Verified
from trt_spec.runtime.stream import count_drafted

BUCKETS = (1, 2, 4)  # the k a step runs at (with the loop's k_max): one graph each


def buckets(k_max: int) -> tuple[int, ...]:
    """The k buckets of a loop drafting at most k_max (0: a plain loop, one bucket)."""
    return tuple(sorted({b for b in BUCKETS if b < k_max} | {k_max}))


def bucket(k: int, k_max: int) -> int:
    """The smallest bucket of k_max that holds k drafts (at least 1 where k_max > 0)."""
    assert 0 <= k <= k_max, (k, k_max)
    return next(b for b in buckets(k_max) if b >= k)


def decode(executor, streams: list, m) -> None:
    """One decode step of the device executor's prefilled streams (the module docstring's
    pseudo-code): ks planned on the host, each loop run at its bucket, what every stream
    verified reported to the planner."""
    planner = executor.planner
    planner.follow(executor.gen.engine.planner.config)
    groups = executor.groups(streams)
    # a host drafter's loop (loop.hosted: runtime/device/host_drafts.py) plans each row's
    # length with the engine's planner and reports to it; it runs at its k_max (a row's
    # uploaded length caps it)
    own = [s for loop, group in groups if loop.hosted is None for s in group]
    ks = dict(zip(map(id, own), planner.plan(own, m))) if own else {}
    verified = {}
    for loop, group in groups:
        if loop.hosted is None:
            set_step_k(loop, group, [ks[id(s)] for s in group])
        verified.update(zip(map(id, group), executor.decode(loop, group, m)))
    if own:
        planner.report(own, [verified[id(s)] for s in own], m)


def set_step_k(loop, streams: list, ks: list[int]) -> int:
    """Sets loop's k for this step (its bucket) and each stream's cap (state.cap at its slot)
    from the planned ks (capped at the loop's k_max) -> the bucket."""
    ks = [min(k, loop.k_max) for k in ks]
    kb = bucket(max(ks, default=0), loop.k_max)
    loop.k = kb
    if loop.drafter is not None:
        loop.drafter.k = kb  # (its propose drafts kb, its commit keeps what it fed of them)
    nb = max(s.slot for s in streams) + 1
    cap = np.zeros(nb, dtype=np.int64)
    for s, k in zip(streams, ks):
        cap[s.slot] = k
    loop.state.cap[:nb].copy_(torch.from_numpy(cap))  # (a fixed address: graphs read it)
    return kb


def probe(groups: list, widths: range, repeats: int = REPEATS) -> dict[int, float]:
    """cost_probe.py's measurement on the device: times the score phase (one target forward
    over every loop's slots, no drafting) at each width T (rows: the last token and T - 1
    drafts), rounds interleaved, the first a warm-up -> {T: median seconds}. The forward
    writes only cache rows from each stream's last token on, which the next step writes
    again (as a rejected draft's rows are), and changes no state."""
    times: dict[int, list[float]] = {t: [] for t in widths}
    for r in range(repeats + 1):
        for t in widths:
            t0 = time.perf_counter()
            for loop, streams in groups:
                _score_at(loop, max(s.slot for s in streams) + 1, t - 1)
            elapsed = time.perf_counter() - t0
            if r:
                times[t].append(elapsed)
    return {t: statistics.median(v) for t, v in times.items()}


def _score_at(loop, nb: int, k: int) -> None:
    kept = loop.k
    loop.k = min(k, loop.width - 1)
    zeros = torch.zeros(nb, loop.k, dtype=torch.long, device=loop.device)
    try:
        loop._score(nb, {"drafts": zeros, "valid": zeros.bool()})
        if loop.device.type == "cuda":
            torch.cuda.synchronize(loop.device)
    finally:
        loop.k = kept


class DevicePlanner(SpeculationPlanner):
    """The host's planner over the device executor's streams (module docstring): costs
    probed and observed on the device; `auto` k's length planned per step from acceptance
    by position and those costs (there is no drafter gate on the device)."""

    def __init__(self, executor):
        gen = executor.gen
        super().__init__(gen.engine.planner.config, gen.cache.max_len, None, None,
                         lambda method: None)
        self.executor = executor

    def follow(self, config) -> None:
        """The Generator's rules (Generator.configure changes the host planner's)."""
        if config is not self.config:
            self.configure(config)

    def drafts(self, s) -> bool:
        return METHODS[s.method].speculative

    def expected_gain(self, s, k, batch, drafting):
        if traits(s.method).picks_length:
            return k, float("inf")
        return self.acceptance(s).best(self.draft_length.costs, s.method, k, batch,
                                       max(drafting, 1))

    def plan(self, streams: list, m) -> list[int]:
        """The host planner's ks; under the gain rules cut to the width the whole step pays
        best at (batch_width.py; the host cuts the drafts in hand, the device its plan:
        its drafts are made on the device); without them (config.fallback off) an `auto`
        stream still drafts the length that pays best (the host's drafter gate, here)."""
        ks = super().plan(streams, m)
        if self.config.fallback:
            if len(streams) < 2 or not any(ks):
                return ks
            acc = [self.acceptance(s) if k else None for s, k in zip(streams, ks)]
            w = self.batch_width.width(self.draft_length, ks, acc)
            return [min(k, w) for k in ks]
        drafting = sum(1 for s in streams if s.num_draft_tokens and self.drafts(s))
        return [min(k, self.expected_gain(s, k, len(streams), drafting)[0])
                if k and s.adaptive else k for s, k in zip(streams, ks)]

    def measure_costs(self, streams: list, m) -> None:
        """The host planner's rule (when to probe, which widths), timed on the device."""
        costs = self.draft_length.costs
        widths = self.probe_widths(streams)
        if widths is None:
            return
        for t, seconds in probe(self.executor.groups(streams), widths).items():
            costs.record(len(streams), t, seconds)
        m.probe_forwards += (REPEATS + 1) * len(widths)

    def report(self, streams: list, verified: list[Verified], m) -> None:
        """What the device's step measured, into the planner's records (as Engine.decode's
        observe): each stream's drafts as Draft rows of the length proposed, the step's
        phase times, the drafter's time a token."""
        drafts = [Draft(np.zeros(v.proposed, dtype=np.int64), None, s.method)
                  for s, v in zip(streams, verified)]
        count_drafted(streams, drafts)
        costs = self.draft_length.costs
        for method in {s.method for s in streams}:
            n = sum(v.proposed for s, v in zip(streams, verified) if s.method == method)
            costs.observe_draft(method, n, m.propose_s * n / max(1, sum(
                v.proposed for v in verified)))
        self.observe(streams, drafts, verified, StepTimes(m.propose_s, m.score_s, m.sample_s))
