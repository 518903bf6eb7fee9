"""Plain decoding at batch 1: the engine's decode step with the Python between two target
runs cut to what such a step does.

A stream that drafts nothing this step and samples greedily, with no logits controls and no
grammar, gets nothing from the general step's inputs built afresh (runtime/backends/base.py
StepGraph.step), the drafts' bookkeeping or, without a drafter, the planner's plan / draft /
observe: each step it runs them all and they return what a plain row needs. At batch 1, on a
CPU, that Python is a visible share of a step (docs/quantization.md, "The lean graph"): not
for its work but for its cold-cache footprint after each session run. So here such a step is

    logits = target.decode_one(cache, slot, last token)   # inputs bound once, written in place
    verify_stream, commit_one                              # the engine's own, isolated
    the step's costs as planner.observe records a plain row

with the same token, caches, stats and step costs as Engine.decode; a target without a lean
path, or a step it would pad (exact decoding's layouts), returns None and decode runs.

Two kinds of stream take it:
    method none                   before the planner runs (`decode`)
    a drafter that drafts nothing the planner gave it k = 0 (the gain rules switched it off,
                                  between probes), or its proposer found nothing to draft
                                  (`undrafted`): the plan and the draft already ran.
                                  Its proposer is handed the step's target row it reads
                                  (hidden_states, eagle3_features: decode_one's rows) and
                                  committed as after a general step's plain row, so it catches
                                  up when it drafts again as it would have anyway.
"""

from __future__ import annotations

import time

from trt_spec.runtime import engine as engine_module  # (engine imports this module)
from trt_spec.runtime.speculation.draft import Draft
from trt_spec.runtime.stream import StepMetrics, Stream
from trt_spec.runtime.stream_step import FAILED, verify_stream


def lean(s: Stream) -> bool:
    """s samples greedily, without logits controls or a grammar."""
    return s.guide is None and s.params.greedy and not s.params.processes_logits


def applies(engine, s: Stream) -> bool:
    """s is a plain greedy stream (no proposer) without logits controls or a grammar."""
    return engine.proposer(s) is None and lean(s)


def decode(engine, s: Stream, m: StepMetrics) -> bool:
    """Engine.decode for [s] where `applies` and the target has a lean step for it -> True;
    False where not, with nothing done (Engine.decode then runs)."""
    if not applies(engine, s):
        return False
    return step(engine, s, m, Draft.none(s.method), 0.0, 0.0)


def undrafted(engine, streams: list[Stream], m: StepMetrics, drafts: list[Draft],
              propose_s: float) -> bool:
    """Engine.decode after the plan and the draft, where one stream decodes, drafted nothing
    and is `lean` -> True; False where not, with nothing done (the general step then runs
    on). propose_s: the drafting's seconds (a proposer that found nothing); the plan's
    (planner.plan_s) count as a plain row's time around its forward, as observe counts it."""
    if len(streams) != 1 or len(drafts[0]) or not lean(streams[0]):
        return False
    return step(engine, streams[0], m, drafts[0], engine.planner.plan_s, propose_s)


def step(engine, s: Stream, m: StepMetrics, draft: Draft, around_s: float,
         propose_s: float) -> bool:
    """One lean plain step of s -> True; False (nothing done) where the target has none."""
    p = engine.proposer(s)
    reads = {p.reads: None} if p is not None and p.reads else None
    t1 = time.perf_counter()
    logits = engine.target.decode_one(engine.cache, s.slot, s.output_ids[-1], reads)  # [vocab]
    if logits is None:
        return False
    t2 = time.perf_counter()
    logits = logits[None]  # [1, vocab]
    rows = {name: [row] for name, row in (reads or {}).items()}  # name -> [[1, D]]
    v = engine.isolated(s, verify_stream, s, draft, logits) or FAILED
    if s.error is None:  # (failed in verify: released there)
        result = engine_module.StepResult([v], [logits], rows, [draft])
        engine.isolated(s, engine.commit_one, s, v, result, 0, m)
    t3 = time.perf_counter()
    engine.planner.observe_plain(t2 - t1, t3 - t2 + around_s)
    s.stats.propose_s += propose_s
    s.stats.score_s += t2 - t1
    s.stats.sample_s += t3 - t2
    m.propose_s, m.score_s, m.sample_s = propose_s, t2 - t1, t3 - t2
    return True
