"""Measures what a step costs at the batch size decoding now, before the engine relies on it.

`auto` k and the policy's fallback weigh a drafted token against c_B(T) / c_B(1), a target
step of T rows per stream relative to a plain step, at batch B. The ratio depends on B: one
row costs little more than two at batch 1 on this CPU (weights dominate), but at batch 4 the
rows add compute for every stream. A prior curve cannot know that, and live steps never show
c_B(1) while every stream drafts. So the first time B streams decode with speculation, the
engine times T = 1 .. K + 1 on those streams' own slots (each step rewound, as a rejected
verification is: the rows written past a stream's length are overwritten later) and records
the medians (draft_length.StepCosts.record); live steps refine them from then on. About
3 * (K + 2) steps, once per batch size.
"""

from __future__ import annotations

import statistics
import time

from trt_spec.runtime.backends.base import StepGraph
from trt_spec.runtime.speculation.draft_length import StepCosts
from trt_spec.runtime.kv_cache import KVCache
from trt_spec.runtime.step_inputs import SlotTokens

REPEATS = 3  # timed rounds over the widths (after one warm-up round)


def probe_step_costs(target: StepGraph, cache: KVCache, streams: list, widths: range,
                     costs: StepCosts, repeats: int = REPEATS) -> dict[int, float]:
    """Times one target step of each width in `widths` over the streams' slots (rounds of
    1, 2, .. interleaved, so drift hits them alike) and records the medians at batch
    len(streams). The cache lengths are as before. -> {T: median seconds}."""
    lengths = {s.slot: int(cache.lengths[s.slot]) for s in streams}
    times: dict[int, list[float]] = {t: [] for t in widths}
    try:
        for r in range(repeats + 1):
            for t in widths:
                requests = [SlotTokens(s.slot, [s.output_ids[-1]] * t, list(range(t)))
                            for s in streams]
                t0 = time.perf_counter()
                target.step(cache, requests)
                elapsed = time.perf_counter() - t0
                for slot, n in lengths.items():
                    cache.rewind(slot, n)
                if r:  # round 0 warms every shape up
                    times[t].append(elapsed)
    finally:
        for slot, n in lengths.items():
            cache.lengths[slot] = n
    medians = {t: statistics.median(v) for t, v in times.items()}
    for t, seconds in medians.items():
        costs.record(len(streams), t, seconds)
    return medians
