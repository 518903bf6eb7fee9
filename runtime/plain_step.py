"""Plain decoding at batch 1: the engine's decode step with the Python between two target
runs cut to what such a step does.

A stream that cannot draft (no proposer), samples greedily, has no logits controls and no
grammar gets nothing from the planner's plan / draft / observe, the drafts' bookkeeping or
the general step's inputs built afresh (runtime/backends/base.py StepGraph.step): each step
it runs them all and they return what a plain row needs. At batch 1, on a CPU, that Python
is a visible share of a step (docs/quantization.md, "The lean graph"): not for its work but
for its cold-cache footprint after each session run. So here such a step is

    logits = target.decode_one(cache, slot, last token)   # inputs bound once, written in place
    verify_stream, commit_one                              # the engine's own, isolated
    the step's costs as planner.observe records a plain row

with the same token, caches, stats and step costs as Engine.decode; a target without a lean
path, or a step it would pad (exact decoding's layouts), returns None and decode runs.
"""

from __future__ import annotations

import time

from trt_spec.runtime import engine as engine_module  # (engine imports this module)
from trt_spec.runtime.speculation.draft import Draft
from trt_spec.runtime.stream import StepMetrics, Stream
from trt_spec.runtime.stream_step import FAILED, verify_stream


def applies(engine, s: Stream) -> bool:
    """s is a plain greedy stream without logits controls or a grammar."""
    return (engine.proposer(s) is None and s.guide is None and s.params.greedy
            and not s.params.processes_logits)


def decode(engine, s: Stream, m: StepMetrics) -> bool:
    """Engine.decode for [s] where `applies` and the target has a lean step for it -> True;
    False where not, with nothing done (Engine.decode then runs)."""
    if not applies(engine, s):
        return False
    t1 = time.perf_counter()
    logits = engine.target.decode_one(engine.cache, s.slot, s.output_ids[-1])  # [vocab]
    if logits is None:
        return False
    t2 = time.perf_counter()
    logits = logits[None]  # [1, vocab]
    draft = Draft.none(s.method)
    v = engine.isolated(s, verify_stream, s, draft, logits) or FAILED
    if s.error is None:  # (failed in verify: released there)
        step = engine_module.StepResult([v], [logits], {}, [draft])
        engine.isolated(s, engine.commit_one, s, v, step, 0, m)
    t3 = time.perf_counter()
    costs = engine.planner.draft_length.costs  # what planner.observe records of a plain row
    costs.observe_step(1, 1, t2 - t1)
    costs.observe_overhead(1, t3 - t2)
    s.stats.score_s += t2 - t1
    s.stats.sample_s += t3 - t2
    m.propose_s, m.score_s, m.sample_s = 0.0, t2 - t1, t3 - t2
    return True
