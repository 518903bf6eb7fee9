"""The methods that draft on the host (suffix, hybrid, auto: the server's default) on the
device executor (runtime/device/host_drafts.py), through `LLM` on the CPU torch backend: the
host proposer drafts, the device verifies its drafts (and runs a picked model head itself);
greedy and seeded sampled output equal the host executor's; acceptance and step costs keep
flowing to the planner that `auto` reads."""

import pytest

torch = pytest.importorskip("torch")

from trt_spec.runtime.methods import METHODS, Speculation  # noqa: E402
from trt_spec.runtime.sampling import SamplingParams  # noqa: E402

OPTIONS = dict(max_num_seqs=10, max_model_len=96)
# repeating prompts: the lookups find drafts in them
PROMPTS = ["a b c a b c a b", "the cat sat on the mat the cat", "x y z x y z x y z x"]
GREEDY = SamplingParams(max_tokens=16, ignore_eos=True)
SAMPLED = SamplingParams(max_tokens=12, temperature=0.9, top_p=0.95, seed=7, ignore_eos=True)
CASES = [("suffix", 3), ("suffix", 1), ("hybrid", 2), ("hybrid", 3), ("auto", 3)]


@pytest.fixture(scope="module")
def llms(host_and_device, tiny_vocab_engine):
    return host_and_device(tiny_vocab_engine, **OPTIONS)


def both(llms, params, method, k, prompts=PROMPTS):
    return [llms[e].generate(prompts, params, method=method, num_draft_tokens=k, chat=False)
            for e in ("host", "device")]


def test_the_registry_names_the_host_drafting_methods():
    assert {n for n, m in METHODS.items() if m.host_drafts} == \
        {"suffix", "hybrid", "auto"}


@pytest.mark.parametrize("method,k", CASES)
def test_greedy_output_equals_the_host_executors(llms, method, k):
    host, device = both(llms, GREEDY, method, k)
    assert [o.token_ids for o in device] == [o.token_ids for o in host]
    assert all(len(o.token_ids) == 16 for o in device)
    assert {(o.metrics.executor, o.metrics.fallback) for o in device} == {("device", None)}
    assert {o.metrics.executor for o in host} == {"host"}
    assert sum(o.metrics.proposed_tokens for o in device) > 0


@pytest.mark.parametrize("method,k", [("suffix", 3), ("hybrid", 3), ("auto", 3)])
def test_seeded_sampled_output_equals_the_host_executors(llms, method, k):
    host, device = both(llms, SAMPLED, method, k)
    assert [o.metrics.executor for o in device] == ["device"] * 3
    assert [o.token_ids for o in device] == [o.token_ids for o in host]


def test_the_model_head_a_proposer_picks_drafts_on_the_device(host_and_device,
                                                              tiny_vocab_engine):
    """Where the lookup finds too little (fresh prompts, fresh engines), hybrid picks its head
    (mtp): the device head fills the host's placeholder rows, verified as the others."""
    fresh = ["one two three four", "five six seven eight nine", "ten eleven"]
    host, device = both(host_and_device(tiny_vocab_engine, **OPTIONS), GREEDY, "hybrid", 3,
                        fresh)
    assert [o.token_ids for o in device] == [o.token_ids for o in host]
    assert {o.metrics.executor for o in device} == {"device"}
    assert any("mtp" in o.metrics.drafted_by for o in device)


def test_a_lookup_drafts_from_earlier_requests_on_the_device(llms):
    """A finished request's tokens join the suffix cache (its release, as on the host): the
    same prompt asked again drafts its whole answer and accepts it."""
    prompt = ["q r s t u v"]
    first, = llms["device"].generate(prompt, GREEDY, method="suffix", num_draft_tokens=3,
                                     chat=False)
    again, = llms["device"].generate(prompt, GREEDY, method="suffix", num_draft_tokens=3,
                                     chat=False)
    assert again.token_ids == first.token_ids
    assert again.metrics.executor == "device"
    assert again.metrics.accepted_tokens > first.metrics.accepted_tokens
    assert again.metrics.accepted_tokens >= 10


def test_auto_records_its_sources_acceptance_from_the_device(llms):
    """auto's choice reads acceptance per source ("auto:<source>") and step costs: the device
    executor's steps record them as the host's do; its drafts name their source."""
    planner = llms["device"].generator.engine.planner
    before = dict(planner.draft_length.costs.step)
    out = llms["device"].generate(PROMPTS, GREEDY, method="auto", num_draft_tokens=3,
                                  chat=False)
    assert {o.metrics.executor for o in out} == {"device"}
    keys = {m for m, _ in planner.draft_length.positions if m.startswith("auto:")}
    assert keys, planner.draft_length.positions.keys()
    assert planner.draft_length.costs.step != before
    drafted = {k for o in out for k in o.metrics.drafted_by}
    assert drafted and drafted <= {"suffix", "mtp"}, drafted


def run(llm, specs):
    """Every (prompt, params, method, k) queued at once and stepped to the end."""
    sched = llm.scheduler
    requests = sched.enqueue_all([sched.prepare(llm.tokenizer.encode(p), params,
                                                Speculation(m, k))
                                  for p, params, m, k in specs])
    while not all(c.done for r in requests for c in r.choices):
        sched.step()
    return requests


MIXED = [(PROMPTS[0], GREEDY, "suffix", 3), (PROMPTS[1], GREEDY, "mtp", 3),  # (4 loops)
         (PROMPTS[2], SAMPLED, "suffix", 3), (PROMPTS[0], SAMPLED, "mtp", 3),
         (PROMPTS[1], SAMPLED, "hybrid", 3), (PROMPTS[2], GREEDY, "auto", 3)]


def test_a_batch_mixing_suffix_and_mtp_streams(llms):
    device, host = (run(llms[e], MIXED) for e in ("device", "host"))
    for d, h, spec in zip(device, host, MIXED):
        s = d.stream
        assert s.output_ids == h.stream.output_ids, spec[2:]
        assert (s.executor, s.fallback) == ("device", None), (spec[2:], s.fallback)
        assert len(s.sources) == len(s.output_ids)
