"""A drafter the planner switches off (k = 0) costs what plain decoding does: at batch 1 its
stream takes the lean plain step (runtime/plain_step.py, the target's decode_one) instead of
the general step, and its drafter catches up on what it missed when it drafts again, drafting
exactly what it would have drafted had every step been a general one. The plan is forced here
(off, then on, then off ...; no timing), and every output equals plain decoding's."""

import pytest

from trt_spec.runtime.generator import Generator
from trt_spec.runtime.methods import Speculation
from trt_spec.runtime.sampling import SamplingParams
from trt_spec.runtime.scheduler import generate_ids

PROMPT = [16, 28, 40, 16, 28, 40, 16, 28]
GREEDY = SamplingParams(max_tokens=40, ignore_eos=True)
ON_EVERY = 5  # of each 5 decode steps, the last drafts: the head sits out 4 then catches up
HEADS = ["mtp", "eagle", "eagle3", "vanilla"]


@pytest.fixture(scope="module")
def want(tiny_vocab_engine):
    gen = Generator(tiny_vocab_engine, max_len=64)
    return generate_ids(gen, [PROMPT], GREEDY, "none")[0].output_ids


def forced_run(engine_dir, method: str, lean: bool) -> tuple[list[int], dict, list]:
    """Decodes PROMPT with `method` at k 2, the plan forced to k = 0 but for one step in
    ON_EVERY (lean False: the target has no lean step, every step is a general one) ->
    (output, forwards by kind {"step", "decode_one"}, the drafts of each step that drafted).
    A verification a lookup drafter's lone stream runs through decode_rows (the bound-once
    form of `step`) counts as a step."""
    gen = Generator(engine_dir, max_len=64, fallback=False)
    target, calls = gen.target, {"step": 0, "decode_one": 0}
    step, one, rows = target.step, target.decode_one, target.decode_rows

    def counted_step(*a, **kw):
        calls["step"] += 1
        return step(*a, **kw)

    def counted_rows(*a, **kw):
        out = rows(*a, **kw)
        calls["step"] += out is not None
        return out

    def counted_one(*a, **kw):
        out = one(*a, **kw) if lean else None
        calls["decode_one"] += out is not None
        return out

    target.step, target.decode_one, target.decode_rows = counted_step, counted_one, counted_rows
    planner, plans = gen.engine.planner, []

    def forced(streams, m):  # k 2 (as room allows) on every ON_EVERY-th decode step, else 0
        plans.append(None)
        on = len(plans) % ON_EVERY == 0
        return [min(2, planner.room(s)) if on else 0 for s in streams]

    draft, drafted = planner.draft, []

    def recorded(streams, ks):
        out = draft(streams, ks)
        if any(ks):
            drafted.append([d.tokens.tolist() for d in out])
        return out

    planner.plan, planner.draft = forced, recorded
    s = gen.stream(PROMPT, GREEDY, Speculation(method, 2))
    gen.engine.admit(s)
    while not s.finished:
        gen.engine.step([s])
    # the lean steps' costs are recorded as a plain row's (planner.observe_plain)
    assert gen.engine.planner.draft_length.costs.step[(1, 1)][1] >= calls["decode_one"]
    return s.output_ids, calls, drafted


@pytest.mark.parametrize("method", HEADS)
def test_a_switched_off_drafter_takes_the_lean_step_and_catches_up(tiny_vocab_engine, want,
                                                                   method):
    rule = Generator(tiny_vocab_engine, max_len=64).target.rule
    if rule.pad_requests or rule.step_min_rows != 1:
        pytest.skip("this machine's exactness probe pads 1-token rows: no lean step")
    out, calls, drafted = forced_run(tiny_vocab_engine, method, lean=True)
    assert out == want
    # every drafting step drafted (the head caught up on the rows it sat out) ...
    assert drafted and all(len(d[0]) for d in drafted), drafted
    # ... and ran the only general target forwards after the prefill
    assert calls["step"] == 1 + len(drafted), calls
    assert calls["decode_one"] >= (ON_EVERY - 2) * len(drafted), calls
    # the drafts are those of a run whose every step was a general one
    general, calls_general, drafted_general = forced_run(tiny_vocab_engine, method, lean=False)
    assert general == want and calls_general["decode_one"] == 0
    assert drafted == drafted_general
