"""k per step on the device executor (runtime/device/k_buckets.py), through `LLM` on the CPU
torch backend: auto k and the speculation policy's rules (min_acceptance, spec_max_batch, the
gain rules) run on the device, planned on the host from what the device's steps report;
streams of different k share one loop. Greedy and seeded sampled output equal the host
executor's."""

import pytest

torch = pytest.importorskip("torch")

from trt_spec.runtime.device.k_buckets import bucket, buckets  # noqa: E402
from trt_spec.runtime.methods import Speculation  # noqa: E402
from trt_spec.runtime.sampling import SamplingParams  # noqa: E402

OPTIONS = dict(max_num_seqs=6, max_model_len=96)
PROMPTS = ["a b c a b c a b", "the cat sat on the mat the cat", "x y z"]
GREEDY = SamplingParams(max_tokens=16, ignore_eos=True)
SAMPLED = SamplingParams(max_tokens=12, temperature=0.9, top_p=0.95, seed=7, ignore_eos=True)
POLICIES = {  # name -> speculation settings
    "default": {},
    "max_batch": {"spec_max_batch": 1},
    # (the gain rules off: what they decide rests on timings; the acceptance rule's does not)
    "min_acceptance": {"spec_min_acceptance": 0.95, "window": 2, "cooldown": 3,
                       "spec_fallback": False},
    "no_fallback": {"spec_fallback": False},
}


@pytest.fixture(scope="module")
def make(host_and_device, tiny_vocab_engine):
    """(executor, policy) -> an LLM, made once (the policy's host and device pair)."""
    made = {}

    def get(executor, policy="default"):
        if policy not in made:
            made[policy] = host_and_device(tiny_vocab_engine, **OPTIONS, **POLICIES[policy])
        return made[policy][executor]

    return get


def both(make, params, method, k, policy="default"):
    return [make(e, policy).generate(PROMPTS, params, method=method, num_draft_tokens=k,
                                     chat=False) for e in ("host", "device")]


def on_device(outputs) -> bool:
    return {(o.metrics.executor, o.metrics.fallback) for o in outputs} == {("device", None)}


def test_buckets():
    assert buckets(6) == (1, 2, 4, 6) and buckets(2) == (1, 2) and buckets(0) == (0,)
    assert [bucket(k, 6) for k in range(7)] == [1, 1, 2, 4, 4, 6, 6]
    assert bucket(0, 0) == 0
    with pytest.raises(AssertionError):
        bucket(3, 2)


@pytest.mark.parametrize("method,k", [("ngram", "auto"), ("vanilla", "auto:3"),
                                      ("mtp", "auto"), ("eagle3", "auto:3")])
def test_auto_k_greedy_equals_the_host_executors(make, method, k):
    """With the gain rules (they may skip every draft of a weak drafter, from timings) and
    without (every step drafts the length that pays best, at least 1)."""
    for policy in ("default", "no_fallback"):
        host, device = both(make, GREEDY, method, k, policy)
        assert [o.token_ids for o in device] == [o.token_ids for o in host], policy
        assert on_device(device) and {o.metrics.executor for o in host} == {"host"}
    assert sum(o.metrics.proposed_tokens for o in device) > 0
    # what the device reported, the planner's records: acceptance by position, step costs
    planner = make("device", policy).generator.device_executor.planner
    assert planner.draft_length.acceptance(method, False).proposed
    assert planner.draft_length.costs.known(len(PROMPTS))


@pytest.mark.parametrize("method,k", [("mtp", "auto"), ("eagle3", "auto:4"), ("mtp", 3)])
def test_seeded_sampled_output_equals_the_host_executors(make, method, k):
    host, device = both(make, SAMPLED, method, k)
    assert on_device(device)
    assert [o.token_ids for o in device] == [o.token_ids for o in host]


@pytest.mark.parametrize("policy", ["max_batch", "min_acceptance"])
def test_the_policys_rules_run_on_the_device(make, policy):
    for method, k in (("mtp", 3), ("eagle3", "auto:3")):
        host, device = both(make, GREEDY, method, k, policy)
        assert on_device(device), policy
        assert [o.token_ids for o in device] == [o.token_ids for o in host]
        proposed = sum(o.metrics.proposed_tokens for o in device)
        free = sum(o.metrics.proposed_tokens for o in make("device", "no_fallback").generate(
            PROMPTS, GREEDY, method=method, num_draft_tokens=k, chat=False))
        if policy == "max_batch":  # 3 streams decode, more than 1: nobody drafts
            assert proposed == 0 == sum(o.metrics.proposed_tokens for o in host)
        else:  # acceptance below 0.95 over 2 steps: plain steps for a cooldown
            assert 0 < proposed < free, (proposed, free)
    host, device = both(make, SAMPLED, "mtp", 3, policy)
    assert on_device(device) and [o.token_ids for o in device] == [o.token_ids for o in host]


def test_streams_of_different_k_share_one_loop(make):
    """k 1, 3 and auto:2 of one method in one batch: one loop, each row drafting at most its
    own k (the loop's bucket the widest)."""
    specs = [(PROMPTS[0], 1), (PROMPTS[1], 3), (PROMPTS[2], "auto:2"), (PROMPTS[0], 3)]
    outs = {}
    for e in ("host", "device"):
        sched = make(e, "no_fallback").scheduler
        tok = make(e, "no_fallback").tokenizer
        requests = sched.enqueue_all([sched.prepare(tok.encode(p), GREEDY,
                                                    Speculation("mtp", k))
                                      for p, k in specs])
        while not all(c.done for r in requests for c in r.choices):
            sched.step()
        outs[e] = [r.stream for r in requests]
    for d, h in zip(outs["device"], outs["host"]):
        assert d.output_ids == h.output_ids and len(d.output_ids) == 16
        assert (d.executor, d.fallback) == ("device", None)
    ex = make("device", "no_fallback").generator.device_executor
    assert ex.loops["mtp"].k_max >= 3  # (one loop a method: the dict's key)
    steps = [s.stats.target_forwards - 1 for s in outs["device"]]  # decode steps
    proposed = [s.stats.proposed for s in outs["device"]]
    assert proposed[0] <= steps[0] < proposed[1] <= 3 * steps[1]
    assert proposed[2] <= 2 * steps[2]
