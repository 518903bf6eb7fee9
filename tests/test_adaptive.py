"""Adaptive drafting on tiny models: `auto` k (confidence gate, measured costs), the suffix
cache across requests, the hybrid proposer, and the policy's fallback from measured gain.
Greedy output stays the plain one; sampled output stays distributed as the target's."""

import numpy as np
import pytest

from trt_spec.runtime.speculation.cost_probe import probe_step_costs
from trt_spec.runtime.speculation.draft_length import BINS, Calibration, DraftLength, StepCosts, prior_cost
from trt_spec.runtime.generator import Generator
from trt_spec.runtime.methods import Speculation
from trt_spec.runtime.proposers.suffix import SuffixCache
from trt_spec.runtime.sampling import SamplingParams, probs_from_logits
from trt_spec.runtime.settings import parse_num_draft_tokens
from trt_spec.runtime.step_inputs import SlotTokens
from trt_spec.runtime.scheduler import generate_ids

PROMPTS = [[5, 17, 99, 3, 17, 99], [42, 8, 77, 61, 23, 11, 90, 8, 77], [4, 4]]
GREEDY = SamplingParams(max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def plain(tiny_heads_engine):
    gen = Generator(tiny_heads_engine, max_batch=3)
    return [s.output_ids for s in generate_ids(gen, PROMPTS, GREEDY)]


# --- the rule ----------------------------------------------------------------------------------

def test_parse_num_draft_tokens():
    assert parse_num_draft_tokens(3) == (3, False)
    assert parse_num_draft_tokens("auto") == (6, True)
    assert parse_num_draft_tokens("auto:3") == (3, True)
    assert parse_num_draft_tokens("5") == (5, False)
    for bad in ("auto:0", "fast", 0, "auto:x"):
        with pytest.raises(ValueError, match="or auto / auto:K"):
            parse_num_draft_tokens(bad)


def test_calibration_learns_acceptance_by_confidence():
    c = Calibration()
    assert c.rate(0.95) == pytest.approx(0.95)  # the prior: a(conf) = conf
    for _ in range(200):
        c.observe([0.95, 0.95], 0)  # confident drafts that are always rejected
    assert c.rate(0.95) < 0.05
    c.observe([0.15, 0.15, 0.15], 1)  # the first accepted, the second judged, the third not
    b = Calibration.bin(0.15)
    assert c.proposed[b] == pytest.approx(4 + 2) and c.accepted[b] == pytest.approx(
        4 * (b + 0.5) / BINS + 1)


def test_step_costs_replace_the_prior_once_measured():
    costs = StepCosts()
    assert costs.ratio(3) == prior_cost(3) and not costs.known(1)
    for _ in range(10):
        costs.observe_step(1, 1, 0.010)
        costs.observe_step(1, 2, 0.010)
        costs.observe_step(1, 3, 0.020)
    assert costs.known(1) and costs.ratio(3) == pytest.approx(2.0)
    assert costs.marginal("m", 1) == pytest.approx(1.0 + 0.07)  # c(3) - c(2), prior drafting
    assert costs.marginal(None, 1) == pytest.approx(1.0)  # a lookup drafts for free


def test_step_costs_are_per_batch_size():
    """At batch 4 a row costs more than at batch 1: each batch size has its own curve."""
    costs = StepCosts()
    for t, ms in ((1, 10), (2, 10.5), (3, 12)):
        costs.record(1, t, ms / 1000)
    for t, ms in ((1, 20), (2, 30), (3, 40)):
        costs.record(4, t, ms / 1000)
    assert costs.known(1) and costs.known(4) and not costs.known(2)
    assert costs.ratio(2, 1) == pytest.approx(1.05) and costs.ratio(2, 4) == pytest.approx(1.5)
    assert costs.step_cost("m", 3, 2, batch=4) == pytest.approx(2.0 + 2 * 0.07)
    assert costs.ratio(2, 2) == prior_cost(2)  # batch 2 not measured: the prior


def test_probe_measures_the_batch_and_leaves_the_cache_as_it_was(tiny_heads_engine):
    gen = Generator(tiny_heads_engine, max_batch=2)
    streams = [gen.stream(p, GREEDY, Speculation("mtp", "auto:3")) for p in PROMPTS[:2]]
    for s in streams:
        gen.engine.admit(s)
    gen.engine.step(streams)  # prefill: each stream has its first token
    before = [int(gen.cache.lengths[s.slot]) for s in streams]
    costs = StepCosts()
    medians = probe_step_costs(gen.target, gen.cache, streams, range(1, 5), costs)
    assert sorted(medians) == [1, 2, 3, 4] and all(v > 0 for v in medians.values())
    assert costs.known(2) and not costs.known(1)
    assert [int(gen.cache.lengths[s.slot]) for s in streams] == before
    # the engine probes on its own the first time 2 streams decode, then decodes exactly
    while not all(s.finished for s in streams):
        gen.engine.step(streams)
    assert gen.engine.planner.draft_length.costs.known(2)
    plain = generate_ids(Generator(tiny_heads_engine, max_batch=2), PROMPTS[:2], GREEDY)
    assert [s.output_ids for s in streams] == [s.output_ids for s in plain]


def test_cost_cache_spares_the_next_process_its_probe(tiny_heads_engine, tmp_path, monkeypatch):
    """With cost_cache on, the costs one engine probed are read by the next one on the same
    folder and machine: it times nothing, and decodes the same tokens."""
    monkeypatch.setenv("TRT_SPEC_CACHE", str(tmp_path))

    def run(**options):
        gen = Generator(tiny_heads_engine, max_batch=2, **options)
        streams = [gen.stream(p, GREEDY, Speculation("mtp", 3)) for p in PROMPTS[:2]]
        for s in streams:
            gen.engine.admit(s)
        probes = 0
        while not all(s.finished for s in streams):
            probes += gen.engine.step(streams).probe_forwards
        return probes, [s.output_ids for s in streams], gen

    first, out, gen = run(cost_cache=True)
    files = list((tmp_path / "step-costs").glob("*.json"))
    assert first > 0 and len(files) == 1
    second, again, gen2 = run(cost_cache=True)
    assert second == 0 and again == out and gen2.engine.planner.draft_length.costs.known(2)
    assert run()[0] > 0  # off (the default outside `serve`): every process probes
    files[0].write_text("not json")  # a damaged file is ignored: the engine probes again
    assert run(cost_cache=True)[0] > 0


def test_gate_stops_where_a_token_no_longer_pays():
    rule = DraftLength()
    gate = rule.gate("m", [True, False])
    assert gate.more(0, 0.99) and gate.more(0, 0.99)  # confident: keep drafting
    assert not gate.more(0, 0.2)  # 0.99 * 0.99 * 0.2 * 0.2 < the cost of one more row
    assert gate.more(1, 0.01)  # a fixed-k stream always drafts its k
    assert gate.confidences == [[0.99, 0.99, 0.2], [0.01]]


# --- auto k over exported heads ---------------------------------------------------------------

@pytest.mark.parametrize("method", ["mtp", "eagle", "eagle3"])
@pytest.mark.parametrize("k", ["auto", "auto:2"])
def test_auto_k_is_lossless(tiny_heads_engine, plain, method, k):
    gen = Generator(tiny_heads_engine, max_batch=3)
    streams = generate_ids(gen, PROMPTS, GREEDY, method, k)
    assert [s.output_ids for s in streams] == plain
    kmax = parse_num_draft_tokens(k)[0]
    for s in streams:
        assert s.adaptive and len(s.stats.proposed_per_position) <= kmax
    key = "mtp/position" if method == "mtp" else method  # MTP plans k by position
    assert gen.engine.planner.draft_length.calibration[key].proposed.sum() > BINS * 4  # it learned


def test_auto_k_drafts_less_where_the_drafter_is_unsure(tiny_heads_engine):
    """Random heads are rarely right: `auto` ends most steps after the first draft, and a
    stream that does not pay falls back to plain steps for a while."""
    from trt_spec.runtime.settings import SpeculationConfig

    gen = Generator(tiny_heads_engine, max_batch=1)
    params = SamplingParams(max_tokens=80, ignore_eos=True)
    # the fixed k, every step (under the gain rules it too would draft less: what pays)
    fixed = generate_ids(Generator(tiny_heads_engine, max_batch=1,
                      speculation=SpeculationConfig(fallback=False)), 
        PROMPTS[:1], params, "mtp", 6)[0]
    auto = generate_ids(gen, PROMPTS[:1], params, "mtp", "auto:6")[0]
    assert auto.output_ids == fixed.output_ids
    assert auto.stats.proposed < fixed.stats.proposed / 2, (auto.stats.proposed,
                                                            fixed.stats.proposed)


# --- suffix cache and hybrid ------------------------------------------------------------------

def test_suffix_cache_matches_earlier_requests_and_evicts_the_oldest():
    cache = SuffixCache(max_tokens=12)
    cache.add([1, 2, 3, 4, 5])
    cache.add([7, 8, 9])
    ctx = np.array([0, 2, 3])
    assert cache.match(ctx, 5, 1, 3).tolist() == [4, 5]  # stops at the sequence's end
    assert cache.match(np.array([8]), 3, 1, 3).tolist() == [9]
    cache.add([10, 11, 12, 13, 14])  # 13 tokens: the first sequence leaves
    assert len(cache) == 2 and cache.match(ctx, 5, 1, 3).tolist() == []


def test_suffix_drafts_a_repeated_request_from_the_cache(tiny_heads_engine):
    gen = Generator(tiny_heads_engine, max_batch=1)
    params = SamplingParams(max_tokens=32, ignore_eos=True)
    first = generate_ids(gen, PROMPTS[1:2], params, "suffix", 8)[0]
    again = generate_ids(gen, PROMPTS[1:2], params, "suffix", 8)[0]
    ngram = generate_ids(gen, PROMPTS[1:2], params, "ngram", 8)[0]
    assert again.output_ids == first.output_ids == ngram.output_ids
    tau = lambda s: len(s.output_ids) / s.stats.target_forwards  # noqa: E731
    assert tau(again) > 3 > tau(ngram), (tau(again), tau(ngram))


def test_hybrid_is_lossless_and_says_who_drafted(tiny_heads_engine, plain):
    gen = Generator(tiny_heads_engine, max_batch=3)
    assert "hybrid" in gen.methods and "suffix" in gen.methods
    for k in (3, "auto"):
        streams = generate_ids(gen, PROMPTS, GREEDY, "hybrid", k)
        assert [s.output_ids for s in streams] == plain
    streams = generate_ids(gen, PROMPTS, GREEDY, "hybrid", 3)  # the answers are cached now
    by = {}
    for s in streams:
        for name, n in s.metrics().drafted_by.items():
            by[name] = by.get(name, 0) + n
    assert by.get("suffix", 0) > 0 and by.get("mtp", 0) >= 0, by
    assert set(by) <= {"suffix", "mtp"}


# --- method auto ------------------------------------------------------------------------------

@pytest.mark.parametrize("k", [4, "auto"])
def test_method_auto_is_lossless_and_says_what_it_chose(tiny_heads_engine, plain, k):
    gen = Generator(tiny_heads_engine, max_batch=3)
    assert "auto" in gen.methods
    streams = generate_ids(gen, PROMPTS, GREEDY, "auto", k)
    assert [s.output_ids for s in streams] == plain
    by = {}
    for s in streams:
        for name, n in s.metrics().drafted_by.items():
            by[name] = by.get(name, 0) + n
    assert by and set(by) <= {"suffix", "mtp"}, by  # the folder's first head: mtp
    # what each source's drafts were accepted at, within auto: what the next choice reads
    measured = {m.split("/")[0] for m, _ in gen.engine.planner.draft_length.positions
                if m.startswith("auto:")}  # a lookup's by the length of its match
    assert measured == {f"auto:{name}" for name in by}


def test_method_auto_without_drafters_picks_the_lookup_or_nothing(tiny_engine):
    gen = Generator(tiny_engine, max_batch=3)
    assert "auto" in gen.methods and gen.proposer("auto").head is None
    want = [s.output_ids for s in generate_ids(gen, PROMPTS, GREEDY)]
    streams = generate_ids(gen, PROMPTS, GREEDY, "auto", 3)
    assert [s.output_ids for s in streams] == want
    assert all(set(s.metrics().drafted_by) <= {"suffix"} for s in streams)


def test_method_auto_chooses_by_measured_gain():
    """The lookup where its drafts are accepted, the head where its are, nothing where neither
    pays (but one step in PROBE_EVERY drafts), a seeded sample as any other."""
    from types import SimpleNamespace

    from trt_spec.runtime.proposers.auto import PROBE_EVERY, AutoProposer
    from trt_spec.runtime.proposers.base import source_key

    rule = DraftLength()
    for t, ms in ((1, 10), (2, 11), (3, 13), (4, 15), (5, 17)):
        rule.costs.record(1, t, ms / 1000)
    gate = rule.gate("auto", [False], 1)
    head = SimpleNamespace(name="mtp", reads="hidden_states", gated=False)
    auto = AutoProposer(SimpleNamespace(name="suffix"), head)
    greedy = SimpleNamespace(id=1, params=SamplingParams())

    def measure(source, accepted_at):
        acc = rule.acceptance(source_key("auto", source), False)
        acc.proposed, acc.accepted = [300.0] * 4, [300.0 * a for a in accepted_at]

    found = np.array([7, 8, 9])
    measure("suffix/1", [0.9, 0.8, 0.7, 0.6])
    measure("mtp", [0.3, 0.1, 0.0, 0.0])
    assert auto.choose(greedy, found, 4, gate, 1) == ("suffix", 3)
    measure("suffix/1", [0.05, 0.0, 0.0, 0.0])
    measure("mtp", [0.7, 0.5, 0.1, 0.0])
    assert auto.choose(greedy, found, 4, gate, 1) == ("mtp", 2)
    # one step in PROBE_EVERY that drafts fewer than it could drafts one position more
    other = SimpleNamespace(id=3, params=SamplingParams())
    picks = [auto.choose(other, found, 4, gate, 1) for _ in range(2 * PROBE_EVERY)]
    assert picks.count(("mtp", 3)) == 2 and picks.count(("mtp", 2)) == 2 * PROBE_EVERY - 2
    measure("suffix/3", [0.9, 0.8, 0.7, 0.6])  # a longer match is measured apart
    assert auto.choose(greedy, found, 4, gate, 1, n=3) == ("suffix", 3)
    measure("mtp", [0.02, 0.0, 0.0, 0.0])
    picks = [auto.choose(greedy, found, 4, gate, 1) for _ in range(2 * PROBE_EVERY)]
    assert picks.count((None, 0)) == 2 * PROBE_EVERY - 2  # the first step and one in 16 probe
    assert [j for src, j in picks if src] == [1, 1]  # ... at the best length, not all k
    # a seeded sample is chosen for as any sample (its tokens do not depend on the choice)
    for n in (3, 1):
        seeded = SimpleNamespace(id=10 + n, params=SamplingParams(temperature=0.7, seed=3))
        free = SimpleNamespace(id=20 + n, params=SamplingParams(temperature=0.7))
        assert auto.choose(seeded, found[:n], 4, gate, 1) == \
            auto.choose(free, found[:n], 4, gate, 1)


class FakeHead:
    """A model drafter for hybrid's rules: drafts 0, 1, ... and records the ks it was asked."""
    name, reads, gated = "mtp", "hidden_states", False

    def __init__(self):
        self.asked: list[list[int]] = []

    def propose(self, streams, ks, gate=None):
        from trt_spec.runtime.proposers.base import Drafts

        self.asked.append(list(ks))
        return Drafts([np.arange(k) for k in ks], [None] * len(ks))

    def release(self, stream):
        pass


def test_hybrid_verifies_what_pays_of_a_fixed_k():
    """Under the gain rules hybrid's k is the most either source drafts: the head's length and
    the lookup's cut follow their own acceptance within hybrid; without the rules, k."""
    from types import SimpleNamespace

    from trt_spec.runtime.proposers.base import Drafts
    from trt_spec.runtime.proposers.hybrid import HybridProposer

    rule = DraftLength()
    for t, ms in ((1, 10), (2, 11), (3, 13), (4, 15), (5, 17)):
        rule.costs.record(1, t, ms / 1000)
    for source, rates in (("mtp", [0.5, 0.05, 0.0, 0.0]), ("suffix", [0.9, 0.8, 0.1, 0.0])):
        acc = rule.acceptance(f"hybrid:{source}", False)
        acc.proposed, acc.accepted = [300.0] * 4, [300.0 * a for a in rates]
    head = FakeHead()
    asked = head.asked
    lookup = SimpleNamespace(name="suffix", propose=lambda streams, ks: Drafts(
        [np.array([5, 6, 7, 8]), np.array([], dtype=np.int64)], [None, None]))
    streams = [SimpleNamespace(id=i, params=SamplingParams()) for i in range(2)]
    for measured, want_lookup, want_head in ((True, 2, 1), (False, 4, 4)):
        hybrid = HybridProposer(lookup, head, measured=lambda: measured)
        d = hybrid.propose(streams, [4, 4], rule.gate("hybrid", [False, False], 1))
        assert len(d.tokens[0]) == want_lookup and d.sources[0] == "suffix"
        assert asked[-1] == [0, want_head] and d.sources[1] == "mtp"


def test_hybrid_drafts_nothing_where_no_length_pays():
    """A large batch whose verified rows cost nearly a step each, and a weak head: hybrid's head
    drafts nothing (a plain step) instead of one token that loses, but probes now and then."""
    from types import SimpleNamespace

    from trt_spec.runtime.speculation.policy import PROBE_EVERY, SURE_LOSS_SPACING
    from trt_spec.runtime.proposers.base import Drafts
    from trt_spec.runtime.proposers.hybrid import HybridProposer

    rule = DraftLength()
    for t, ms in ((1, 10), (2, 19), (3, 28)):  # batch 8: each row ~0.9 of a step
        rule.costs.record(8, t, ms / 1000)
    acc = rule.acceptance("hybrid:mtp", False)
    acc.proposed, acc.accepted = [300.0] * 2, [90.0, 20.0]  # 0.3, then 0.07
    head = FakeHead()
    asked = head.asked
    lookup = SimpleNamespace(name="suffix", propose=lambda streams, ks: Drafts(
        [np.array([], dtype=np.int64)], [None]), release=lambda s: None)
    stream = SimpleNamespace(id=3, params=SamplingParams())
    hybrid = HybridProposer(lookup, head)
    steps = PROBE_EVERY * SURE_LOSS_SPACING
    for _ in range(steps):
        d = hybrid.propose([stream], [2], rule.gate("hybrid", [False], 8))
    assert asked[:-1] == [[0]] * (steps - 1) and asked[-1] == [1]  # one probe, of one token
    assert d.sources == ["mtp"]
    hybrid.release(stream)
    assert not hybrid.skipped


# --- sampling stays the target's distribution -------------------------------------------------

@pytest.mark.parametrize("method,k", [("mtp", "auto"), ("hybrid", "auto"), ("eagle3", "auto:3"),
                                      ("auto", 4)])
def test_sampled_adaptive_output_follows_the_target(tiny_heads_engine, method, k):
    """The second output token (the first one a verification decides) over many seeds has
    the target's exact marginal: sum over the first token t of p(t) p(. | t)."""
    gen = Generator(tiny_heads_engine, max_batch=1)
    prompt = PROMPTS[1]
    params = dict(max_tokens=6, temperature=1.0, ignore_eos=True)
    cache = gen.cache
    slot = cache.allocate()
    try:
        out = gen.target.step(cache, [SlotTokens(slot, prompt, [len(prompt) - 1])])
        p0 = probs_from_logits(out.logits[0][-1], 1.0)
        exact = np.zeros_like(p0)
        for t in np.nonzero(p0 > 1e-4)[0]:
            cache.lengths[slot] = len(prompt)
            nxt = gen.target.step(cache, [SlotTokens(slot, [int(t)], [0])])
            exact += p0[t] * probs_from_logits(nxt.logits[0][-1], 1.0)
    finally:
        cache.release(slot)
    n = 1500
    counts = np.zeros_like(exact)
    for seed in range(n):
        s = generate_ids(gen, [prompt], SamplingParams(seed=seed, **params), method, k)[0]
        counts[s.output_ids[1]] += 1
    tv = 0.5 * np.abs(counts / n - exact).sum()
    # sampling noise alone: E|f - p| ~ sqrt(2 p (1 - p) / (pi n)) per token
    noise = 0.5 * np.sqrt(2 * exact * (1 - exact) / (np.pi * n)).sum()
    assert tv < 1.5 * noise + 0.01, (tv, noise)


# --- the policy's fallback from measured gain -----------------------------------------------

def test_fallback_backs_off_while_speculation_loses_and_resets_once_it_pays():
    from types import SimpleNamespace

    from trt_spec.runtime.speculation.policy import SpeculationPolicy
    from trt_spec.runtime.settings import SpeculationConfig

    policy = SpeculationPolicy(SpeculationConfig(window=4, cooldown=2, max_cooldown=8,
                                                 margin=0.0), 1000)  # (break-even: 6 for 6)
    s = SimpleNamespace(id=1, num_draft_tokens=2, adaptive=False, prompt_ids=[1] * 8,
                        output_ids=[1], params=SamplingParams(max_tokens=500))

    def window(accepted: int) -> None:  # 4 speculative steps, each costing 1.5 plain steps
        for i in range(4):
            if i:  # (the first step's plan() was the one that ended the cooldown)
                assert policy.plan([s]) == [2]
            policy.observe(s, 2, accepted, cost=1.5)

    def plain_steps() -> int:
        n = 0
        while policy.plan([s]) == [0]:
            n += 1
        return n  # the plan() that ended the loop drafted: the probe's first step

    window(0)  # 1 token per 1.5: plain decoding is faster
    assert plain_steps() == 2
    window(0)  # the probe loses again: twice as long
    assert plain_steps() == 4
    window(0)
    assert plain_steps() == 8
    window(0)
    assert plain_steps() == 8  # capped at max_cooldown
    window(1)  # 2 tokens per 1.5: pays; the next loss starts from the first cooldown again
    steps = 0
    while policy.plan([s]) == [2]:  # the rolling window turns once losses outweigh the gains
        policy.observe(s, 2, 0, cost=1.5)
        steps += 1
    assert steps == 3 and plain_steps() == 1  # (this plan() was the cooldown's first step)
    off = SpeculationPolicy(SpeculationConfig(window=4, fallback=False), 1000)
    for _ in range(8):
        assert off.plan([s]) == [2]
        off.observe(s, 2, 0, cost=1.5)


def test_expected_gain_skips_drafting_that_does_not_pay_but_keeps_probing():
    from types import SimpleNamespace

    from trt_spec.runtime.speculation.draft_length import PositionAcceptance
    from trt_spec.runtime.speculation.policy import PROBE_EVERY, SpeculationPolicy
    from trt_spec.runtime.settings import SpeculationConfig

    acc = PositionAcceptance()
    assert acc.expected_tokens(2) == pytest.approx(1 + 0.8 + 0.64)  # the optimistic prior
    for _ in range(300):
        acc.observe(2, 1)  # the first draft always accepted, the second never
    assert acc.expected_tokens(2) == pytest.approx(2.0, abs=0.01)
    costs = StepCosts()
    for t, ms in ((1, 10), (2, 11), (3, 12)):
        costs.record(1, t, ms / 1000)
    for t, ms in ((1, 20), (2, 35), (3, 45)):
        costs.record(4, t, ms / 1000)
    assert acc.gain(costs, "m", 2, batch=1) > 1 > acc.gain(costs, "m", 2, batch=4, drafters=4)
    # auto: the best length up to k (one draft: ~2 tokens for 1.1 + 0.07; the first
    # position's prior weighs one step against ~95 measured)
    assert acc.rate(0) == pytest.approx(1.0, abs=0.003)
    assert acc.gain(costs, "m", 2, 1, best_of=True) == pytest.approx((1 + acc.rate(0)) / 1.17)

    policy = SpeculationPolicy(SpeculationConfig(), 1000)
    s = SimpleNamespace(id=1, num_draft_tokens=2, adaptive=False, prompt_ids=[1] * 8,
                        output_ids=[1], params=SamplingParams(max_tokens=500))
    ks = [policy.plan([s], lambda s, k: (k, 0.9))[0] for _ in range(2 * PROBE_EVERY)]
    assert ks[0] == 2 and ks[PROBE_EVERY] == 2 and sum(ks) == 4  # probes, plain otherwise
    # a measured loss (below SURE_LOSS): 4x fewer probes, none on the first step
    sure = SimpleNamespace(**{**vars(s), "id": 4})
    ks = [policy.plan([sure], lambda s, k: (k, 0.5))[0] for _ in range(8 * PROBE_EVERY)]
    assert ks[0] == 0 and sum(ks) == 4 and ks[4 * PROBE_EVERY - 1] == 2
    short = SimpleNamespace(**{**vars(s), "id": 3, "num_draft_tokens": 4})
    ks = [policy.plan([short], lambda s, k: (1, 0.9))[0] for _ in range(2 * PROBE_EVERY)]
    assert ks[0] == 1 and ks[PROBE_EVERY] == 1 and sum(ks) == 2  # a probe drafts the best k'

    assert policy.plan([s], lambda s, k: (k, 1.2)) == [2]
    # judged as any other: a seed reproduces its output whatever the policy drafts
    seeded, free = (SimpleNamespace(**{**vars(s), "id": i, "params": SamplingParams(
        max_tokens=500, temperature=0.8, seed=seed)}) for i, seed in ((5, 1), (6, None)))
    ks = [policy.plan([seeded], lambda s, k: (k, 0.1))[0] for _ in range(5)]
    assert ks == [policy.plan([free], lambda s, k: (k, 0.1))[0] for _ in range(5)]
    assert sum(ks) < 10


def test_a_fixed_k_drafts_its_best_shorter_length_and_probes_the_rest():
    """k is the most a step drafts: where the later positions cost more than they add, the
    policy drafts the best k' (one step in PROBE_EVERY drafts k' + 1, so the next position
    stays measured)."""
    from types import SimpleNamespace

    from trt_spec.runtime.speculation.draft_length import PositionAcceptance
    from trt_spec.runtime.speculation.policy import PROBE_EVERY, SpeculationPolicy
    from trt_spec.runtime.settings import SpeculationConfig

    acc = PositionAcceptance()
    for _ in range(300):
        acc.observe(4, 1)  # only the first draft is ever accepted
    costs = StepCosts()
    for t, ms in ((1, 10), (2, 11), (3, 13), (4, 16), (5, 19)):
        costs.record(1, t, ms / 1000)
    best, gain = acc.best(costs, "m", 4, batch=1)
    assert best == 1 and gain == pytest.approx(2 / (1.1 + 0.07), rel=0.02)
    assert acc.gain(costs, "m", 4, 1) < 1 < gain  # all four would lose; one pays

    policy = SpeculationPolicy(SpeculationConfig(), 1000)
    s = SimpleNamespace(id=1, num_draft_tokens=4, adaptive=False, prompt_ids=[1] * 8,
                        output_ids=[1], params=SamplingParams(max_tokens=500))
    judge = lambda s, k: acc.best(costs, "m", k, batch=1)  # noqa: E731
    ks = [policy.plan([s], judge)[0] for _ in range(2 * PROBE_EVERY)]
    assert ks[0] == 2 and ks[PROBE_EVERY] == 2  # probes: one position past the best
    assert ks.count(1) == 2 * PROBE_EVERY - 2
    off = SpeculationPolicy(SpeculationConfig(fallback=False), 1000)
    assert off.plan([s], judge) == [4]  # no fallback: exactly k


def test_batch_width_cuts_a_step_to_what_pays_and_probes_one_position_more():
    """Two streams at batch 2: w* weighs both streams' expected tokens against c_B(w + 1);
    a plain step (w = 0) where no width beats B tokens; one cut step in PROBE_EVERY keeps
    one draft more than w*, not the widest."""
    from trt_spec.runtime.speculation.batch_width import PROBE_EVERY, BatchWidth
    from trt_spec.runtime.speculation.draft_length import PositionAcceptance

    rule = DraftLength()
    for t, ms in ((1, 10), (2, 12), (3, 16), (4, 20), (5, 24)):
        rule.costs.record(2, t, ms / 1000)

    def accepted_at(*rates):
        acc = PositionAcceptance()
        acc.proposed, acc.accepted = [300.0] * len(rates), [300.0 * a for a in rates]
        return acc

    good, weak = accepted_at(0.9, 0.2, 0.1, 0.0), accepted_at(0.05, 0.0, 0.0, 0.0)
    # width 1: (2 + 0.9 + 0.05) / 1.2 = 2.46 beats plain's 2 and width 2's (3.15 / 1.6)
    width = BatchWidth()
    assert width.width(rule, [4, 4], [good, weak]) == 2  # the first cut step probes w* + 1
    widths = [width.width(rule, [4, 4], [good, weak]) for _ in range(2 * PROBE_EVERY)]
    assert widths.count(2) == 2 and widths.count(1) == 2 * PROBE_EVERY - 2
    # neither pays: plain steps, probing width 1
    widths = [BatchWidth().width(rule, [4, 4], [weak, weak])] + \
        [width.width(rule, [4, 4], [weak, weak]) for _ in range(PROBE_EVERY)]
    assert widths[0] == 1 and widths[1:].count(0) >= PROBE_EVERY - 1
    assert width.width(rule, [0, 0], [None, None]) == 0


def test_a_width_known_only_from_its_probe_keeps_the_probes_ratio_as_c1_moves():
    """A probe under load timed c(1..3) at 20 / 22 / 26 ms; live plain steps then run at 10 ms
    and no step of 3 rows follows (the curve says they do not pay, so they are never run):
    c(3) is read as the probe's ratio to its own c(1), 1.3, not 26 / 10."""
    costs = StepCosts()
    for t, ms in ((1, 20), (2, 22), (3, 26)):
        costs.record(1, t, ms / 1000)
    for _ in range(200):
        costs.observe_step(1, 1, 0.010)
    assert costs.ratio(3) == pytest.approx(1.3, rel=0.01)
    assert costs.ratio(2) == pytest.approx(1.1, rel=0.01)
    for _ in range(200):  # steps of 3 rows measured live: they win
        costs.observe_step(1, 3, 0.020)
    assert costs.ratio(3) == pytest.approx(2.0, rel=0.01)


def test_one_rejection_does_not_close_a_position_for_good():
    """A position verified once and rejected keeps a share of the prior (it is tried again
    while that share pays); many rejections close it."""
    from trt_spec.runtime.speculation.draft_length import PositionAcceptance

    acc = PositionAcceptance()
    acc.observe(2, 1)  # the first draft accepted, the second not
    assert 0.2 < acc.rate(1) < 0.5
    for _ in range(50):
        acc.observe(2, 1)
    assert acc.rate(1) < 0.05 and acc.rate(0) > 0.95
    assert acc.rate(1) <= acc.rate(0)


def test_a_sources_first_rejection_does_not_close_it():
    """The first position keeps a prior too: a lookup source (a match length, a corpus bin)
    rejected the first time it drafted is drafted again while that share pays, where before
    its rate read 0 and only the policy's rare probes ever measured it again."""
    from trt_spec.runtime.speculation.draft_length import PositionAcceptance

    costs = StepCosts()
    for t, ms in ((1, 10), (2, 12), (3, 14)):
        costs.record(1, t, ms / 1000)
    acc = PositionAcceptance()
    acc.observe(1, 0)
    assert acc.rate(0) == pytest.approx(0.4)  # (0 + 0.8) / (1 + 1)
    assert acc.best(costs, None, 2, batch=1)[1] > 1  # 1.4 tokens for 1.2: still drafts
    for _ in range(5):
        acc.observe(1, 0)
    assert acc.best(costs, None, 2, batch=1)[1] < 1  # rejected again and again: it stops


def test_a_cut_draft_verifies_one_position_more_now_and_then():
    """A source whose best length cuts its drafts short (only the first position measured
    to pay) verifies one position more on every PROBE_EVERY-th such step, so an early
    rejection past the cut is measured again instead of fixing the cut for good; the suffix
    proposer cuts its drafts so."""
    from types import SimpleNamespace

    from trt_spec.runtime.proposers.base import source_key
    from trt_spec.runtime.proposers.suffix import SuffixProposer
    from trt_spec.runtime.speculation.draft_length import PositionAcceptance
    from trt_spec.runtime.speculation.policy import PROBE_EVERY

    acc = PositionAcceptance()
    lengths = [acc.longer(1, 4) for _ in range(2 * PROBE_EVERY)]
    assert lengths.count(2) == 2 and lengths.count(1) == 2 * PROBE_EVERY - 2
    assert acc.longer(4, 4) == 4 and acc.longer(3, 3) == 3  # not cut: not counted
    assert [acc.longer(1, 4) for _ in range(PROBE_EVERY)].count(2) == 1

    rule = DraftLength()
    for t, ms in ((1, 10), (2, 12), (3, 15), (4, 18), (5, 21)):
        rule.costs.record(1, t, ms / 1000)
    measured = rule.acceptance(source_key("suffix", "2"), False)
    measured.proposed, measured.accepted = [100.0, 100.0, 100.0, 100.0], [90.0, 0.0, 0.0, 0.0]
    suffix = SuffixProposer(measured=lambda: True)
    gate = SimpleNamespace(rule=rule, batch=1, skips=lambda *a: False)
    s = SimpleNamespace(id=1, params=SamplingParams())
    lengths = [suffix.length(s, 0, "2", 4, gate, 1) for _ in range(2 * PROBE_EVERY)]
    assert lengths.count(2) == 2 and lengths.count(1) == 2 * PROBE_EVERY - 2


def test_suffix_at_auto_k_is_cut_by_what_found_each_draft_not_again_by_position(tiny_engine):
    """Under the gain rules, a suffix draft at k = auto keeps the length its source's
    acceptance picked (a 4-gram match accepted whole keeps 4 tokens), where the engine's
    pooled cut by position, fed rejections of weaker sources, would shorten it; without the
    gain rules the cut by position is the only one, and stays."""
    from types import SimpleNamespace

    from trt_spec.runtime.proposers.base import source_key
    from trt_spec.runtime.speculation.planner import lookup_key

    gen = Generator(tiny_engine, max_batch=1)
    planner = gen.engine.planner
    rule = planner.draft_length
    for t, ms in ((1, 10), (2, 12), (3, 14), (4, 16), (5, 18)):
        rule.costs.record(1, t, ms / 1000)
    strong = rule.acceptance(source_key("suffix", "4"), False)
    strong.proposed, strong.accepted = [100.0] * 4, [100.0] * 4
    pooled = rule.calib(lookup_key("suffix"))  # every position after the first: rejected
    pooled.proposed[:], pooled.accepted[:] = 100.0, 0.0
    pooled.accepted[-1] = 100.0
    ids = [5, 6, 7, 8, 9, 10, 11, 12, 5, 6, 7, 8]  # the last 4 tokens matched: 9 10 11 12
    s = SimpleNamespace(id=1, slot=0, prompt_ids=ids, output_ids=[], adaptive=True,
                        method="suffix", params=SamplingParams(), num_draft_tokens=4)
    (row,) = planner.draft_group("suffix", [s], [4], 1)
    assert list(row.tokens) == [9, 10, 11, 12]
    off = Generator(tiny_engine, max_batch=1, fallback=False).engine.planner
    off.draft_length = rule
    (row,) = off.draft_group("suffix", [s], [4], 1)
    assert 1 <= len(row.tokens) < 4
