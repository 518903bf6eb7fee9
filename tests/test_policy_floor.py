"""Speculation that never loses: the gain rules switch a drafter that does not pay off (k = 0)
within a bounded number of steps and then only probe it rarely, keep a drafter that pays, judge
a drafting step by what it measured whole (not the c(T) curve alone) and ask for a margin over
plain decoding. Costs are fixed here (no timing), the outputs those of plain decoding."""

from types import SimpleNamespace

import pytest

from trt_spec.runtime.engine import Engine
from trt_spec.runtime.generator import Generator
from trt_spec.runtime.methods import Speculation
from trt_spec.runtime.sampling import SamplingParams
from trt_spec.runtime.scheduler import generate_ids
from trt_spec.runtime.settings import SpeculationConfig
from trt_spec.runtime.speculation.draft_length import MIN_SAMPLES, PositionAcceptance, StepCosts
from trt_spec.runtime.speculation.policy import PROBE_EVERY, SpeculationPolicy
from trt_spec.runtime.stream import Stream
from tests.test_speculative import ConstantProposer

PROMPT = [42, 8, 77, 61, 23, 11, 90, 8, 77]
TOKENS = 200


class FixedCosts(StepCosts):
    """c(T) / c(1) = 1 + 0.15 (T - 1), a drafted token 0.05 of a plain step, whatever the steps
    take (live timings ignored: the rules are tested, not this machine)."""

    def ratio(self, t: int, batch: int = 1) -> float:
        return 1 + 0.15 * (t - 1)

    def draft_ratio(self, method: str, batch: int = 1) -> float:
        return 0.05

    def known(self, batch: int) -> bool:
        return True

    def plain_seconds(self, batch: int):
        return None  # the per-stream window weighs the model's cost

    def observe_step(self, *args) -> None:
        pass

    def observe_overhead(self, *args, **kwargs) -> None:
        pass

    def observe_draft(self, *args) -> None:
        pass

    def observe_measured(self, *args) -> None:
        pass


def decode_pattern(engine: Engine, s: Stream) -> str:
    """Runs s to its end: one letter a decode step, d where it drafted, - where it did not."""
    engine.admit(s)
    steps = []
    while not s.finished:
        steps.append(engine.step([s]).proposed_tokens)
    return "".join("d" if p else "-" for p in steps[1:])  # (after the prefill step)


def plain(engine_dir) -> list[int]:
    gen = Generator(engine_dir)
    return generate_ids(gen, [PROMPT], SamplingParams(max_tokens=TOKENS, ignore_eos=True))[0] \
        .output_ids


def test_a_drafter_never_accepted_is_switched_off_and_probed_rarely(tiny_spec_engine):
    gen = Generator(tiny_spec_engine)
    constant = ConstantProposer()  # drafts token 0, which the tiny target never emits
    engine = Engine(gen.target, gen.cache, gen.stops, SpeculationConfig(num_draft_tokens=2),
                    lambda method: None if method == "none" else constant)
    engine.planner.draft_length.costs = FixedCosts()
    s = Stream(PROMPT, SamplingParams(max_tokens=TOKENS, ignore_eos=True), "constant", 2)
    pattern = decode_pattern(engine, s)
    # measured until the prior's share of its first position (one step at 0.8) no longer
    # pays: 1 + 0.8 / (n + 1) tokens for 1.2 plain steps from n = 4 rejections; then off
    first = len(pattern) - len(pattern.lstrip("d"))
    assert 1 <= first <= 5 and pattern[first] == "-", pattern
    drafted = [i for i, c in enumerate(pattern) if c == "d"][first:]
    assert len(drafted) <= 1 + len(pattern) // PROBE_EVERY, pattern
    assert all(b - a >= PROBE_EVERY for a, b in zip(drafted, drafted[1:])), pattern
    assert s.stats.accepted == 0
    assert s.output_ids == plain(tiny_spec_engine)


def test_a_drafter_that_pays_keeps_drafting(tiny_self_engine):
    """p = q: every draft is accepted, so every step drafts its k, and the output is plain's."""
    gen = Generator(tiny_self_engine, method="vanilla",
                    speculation=SpeculationConfig(num_draft_tokens=2))
    gen.engine.planner.draft_length.costs = FixedCosts()
    s = gen.stream(PROMPT, SamplingParams(max_tokens=TOKENS, ignore_eos=True),
                   Speculation("vanilla", 2))
    pattern = decode_pattern(gen.engine, s)
    assert pattern.count("d") >= len(pattern) - 1, pattern  # (the last step may lack room)
    assert s.stats.accepted == s.stats.proposed > 0
    assert s.output_ids == plain(tiny_self_engine)


def stream(i: int, k: int = 2):
    return SimpleNamespace(id=i, num_draft_tokens=k, adaptive=False, prompt_ids=[1] * 8,
                           output_ids=[1], params=SamplingParams(max_tokens=10_000))


def drafting_steps(policy: SpeculationPolicy, s, gain: float, steps: int = 4 * PROBE_EVERY
                   ) -> int:
    return sum(policy.plan([s], lambda s, k: (k, gain))[0] > 0 for _ in range(steps))


def test_a_gain_inside_the_margin_is_not_worth_drafting():
    policy = SpeculationPolicy(SpeculationConfig(margin=0.03), 1000)
    assert drafting_steps(policy, stream(1), 1.01) == 4  # probes only (one in PROBE_EVERY)
    assert drafting_steps(policy, stream(2), 1.05) == 4 * PROBE_EVERY
    even = SpeculationPolicy(SpeculationConfig(margin=0.0), 1000)
    assert drafting_steps(even, stream(3), 1.01) == 4 * PROBE_EVERY
    with pytest.raises(ValueError, match="margin=1.5"):
        SpeculationConfig(margin=1.5)


def test_the_window_asks_for_the_margin_too():
    """Emitting 1.02 tokens per unit of cost over a window is a loss at a 3% margin."""
    policy = SpeculationPolicy(SpeculationConfig(window=4, margin=0.03), 1000)
    s = stream(1)
    for _ in range(4):
        assert policy.plan([s]) == [2]
        policy.observe(s, 2, 0, cost=1 / 1.02)
    assert policy.plan([s]) == [0]  # cooling down
    s2 = stream(2)
    for _ in range(8):
        assert policy.plan([s2]) == [2]
        policy.observe(s2, 2, 0, cost=1 / 1.05)


def test_a_drafting_step_is_weighed_by_what_it_measured_whole():
    """The c(T) curve says a drafter accepted 30% of the time pays at k = 1 (1.3 tokens for
    1.15 + 0.07 of a plain step); its steps, past the drafting, take 1.4x what the curve says
    (verifying, bookkeeping): it does not. A drafter accepted 90% of the time still pays."""
    costs = StepCosts()
    for t, ms in ((1, 10.0), (2, 11.5), (3, 13.0)):
        costs.record(1, t, ms / 1000)
    weak, good = PositionAcceptance(), PositionAcceptance()
    for i in range(200):
        weak.observe(1, int(i % 10 < 3))
        good.observe(1, int(i % 10 < 9))
    assert weak.best(costs, "m", 1, 1)[1] > 1.03
    curve, draft = costs.ratio(2, 1), costs.draft_ratio("m", 1)
    for _ in range(MIN_SAMPLES):
        costs.observe_measured("m", 1, 2, 1.4 * curve * costs.plain_seconds(1))
    assert costs.correction("m", 1) == pytest.approx(1.4)
    assert costs.step_cost("m", 2, 1) == pytest.approx(1.4 * curve + draft)
    assert costs.step_cost("m", 1, 0) == 1.0  # a plain step is the unit, uncorrected
    assert weak.best(costs, "m", 1, 1)[1] < 1
    assert good.best(costs, "m", 1, 1)[1] > 1.03
    assert costs.correction("other", 1) == 1.0  # another drafter: not measured yet
    costs.corrected = False  # measured_costs=False: the curve alone
    assert costs.step_cost("m", 2, 1) == pytest.approx(curve + draft)


def test_only_a_drafters_steady_steps_price_its_steps():
    """The first drafting step after plain ones (a probe: a head then takes every row it
    skipped) is not what the drafter's steps cost; the next ones are."""
    import numpy as np

    from trt_spec.runtime.speculation.draft import Draft
    from trt_spec.runtime.speculation.planner import SpeculationPlanner, StepTimes

    planner = SpeculationPlanner(SpeculationConfig(), 1000, None, None, lambda m: None)
    costs = planner.draft_length.costs
    for t, ms in ((1, 10.0), (2, 11.5)):
        costs.record(1, t, ms / 1000)
    s = SimpleNamespace(id=1, method="mtp")
    drafted = Draft(np.array([5]), None, "mtp")
    planner.measure_step([s], [Draft.none("mtp")], StepTimes(0.0, 0.010, 0.0))
    planner.measure_step([s], [drafted], StepTimes(0.001, 0.030, 0.0))  # the probe: slow
    assert ("mtp", 1) not in costs.measured
    planner.measure_step([s], [drafted], StepTimes(0.001, 0.0115, 0.0))
    assert costs.measured[("mtp", 1)][1] == 1
