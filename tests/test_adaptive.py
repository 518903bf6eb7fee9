"""Adaptive drafting on tiny models: `auto` k (confidence gate, measured costs), the suffix
cache across requests, the hybrid proposer, and the policy's fallback from measured gain.
Greedy output stays the plain one; sampled output stays distributed as the target's."""

import numpy as np
import pytest

from trt_spec.runtime.draft_length import BINS, Calibration, DraftLength, StepCosts, prior_cost
from trt_spec.runtime.generator import Generator
from trt_spec.runtime.proposers.suffix import SuffixCache
from trt_spec.runtime.sampling import SamplingParams, probs_from_logits
from trt_spec.runtime.settings import parse_num_draft_tokens
from trt_spec.runtime.step_inputs import SlotTokens

PROMPTS = [[5, 17, 99, 3, 17, 99], [42, 8, 77, 61, 23, 11, 90, 8, 77], [4, 4]]
GREEDY = SamplingParams(max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def plain(tiny_heads_engine):
    gen = Generator(tiny_heads_engine, max_batch=3)
    return [s.output_ids for s in gen.generate_ids(PROMPTS, GREEDY)]


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
    assert costs.ratio(3) == prior_cost(3)
    for _ in range(10):
        costs.observe_step(1, 0.010)
        costs.observe_step(2, 0.010)
        costs.observe_step(3, 0.020)
    assert costs.ratio(3) == pytest.approx(2.0)
    assert costs.marginal("m", 1) == pytest.approx(1.0 + 0.07)  # c(3) - c(2), prior drafting


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
    streams = gen.generate_ids(PROMPTS, GREEDY, method, k)
    assert [s.output_ids for s in streams] == plain
    kmax = parse_num_draft_tokens(k)[0]
    for s in streams:
        assert s.adaptive and len(s.stats.proposed_per_position) <= kmax
    key = "mtp/position" if method == "mtp" else method  # MTP plans k by position
    assert gen.engine.draft_length.calibration[key].proposed.sum() > BINS * 4  # it learned


def test_auto_k_drafts_less_where_the_drafter_is_unsure(tiny_heads_engine):
    """Random heads are rarely right: `auto` ends most steps after the first draft, and a
    stream that does not pay falls back to plain steps for a while."""
    gen = Generator(tiny_heads_engine, max_batch=1)
    params = SamplingParams(max_tokens=80, ignore_eos=True)
    fixed = gen.generate_ids(PROMPTS[:1], params, "mtp", 6)[0]
    auto = gen.generate_ids(PROMPTS[:1], params, "mtp", "auto:6")[0]
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
    first = gen.generate_ids(PROMPTS[1:2], params, "suffix", 8)[0]
    again = gen.generate_ids(PROMPTS[1:2], params, "suffix", 8)[0]
    ngram = gen.generate_ids(PROMPTS[1:2], params, "ngram", 8)[0]
    assert again.output_ids == first.output_ids == ngram.output_ids
    tau = lambda s: len(s.output_ids) / s.stats.target_forwards  # noqa: E731
    assert tau(again) > 3 > tau(ngram), (tau(again), tau(ngram))


def test_hybrid_is_lossless_and_says_who_drafted(tiny_heads_engine, plain):
    gen = Generator(tiny_heads_engine, max_batch=3)
    assert "hybrid" in gen.methods and "suffix" in gen.methods
    for k in (3, "auto"):
        streams = gen.generate_ids(PROMPTS, GREEDY, "hybrid", k)
        assert [s.output_ids for s in streams] == plain
    streams = gen.generate_ids(PROMPTS, GREEDY, "hybrid", 3)  # the answers are cached now
    by = {}
    for s in streams:
        for name, n in s.metrics().drafted_by.items():
            by[name] = by.get(name, 0) + n
    assert by.get("suffix", 0) > 0 and by.get("mtp", 0) >= 0, by
    assert set(by) <= {"suffix", "mtp"}


# --- sampling stays the target's distribution -------------------------------------------------

@pytest.mark.parametrize("method,k", [("mtp", "auto"), ("hybrid", "auto"), ("eagle3", "auto:3")])
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
        s = gen.generate_ids([prompt], SamplingParams(seed=seed, **params), method, k)[0]
        counts[s.output_ids[1]] += 1
    tv = 0.5 * np.abs(counts / n - exact).sum()
    # sampling noise alone: E|f - p| ~ sqrt(2 p (1 - p) / (pi n)) per token
    noise = 0.5 * np.sqrt(2 * exact * (1 - exact) / (np.pi * n)).sum()
    assert tv < 1.5 * noise + 0.01, (tv, noise)
