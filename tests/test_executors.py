"""One loop, two executors (runtime/executors.py), through `LLM` and the server on the CPU torch
backend: with executor="device" the scheduler steps the requests the device executor covers on
it (runtime/device/loop.py) and the others on the host, each keeping its own path and its
reason; greedy output equals the host executor's for every method and k; no module outside
the executors builds an admission loop of its own."""

import ast
from pathlib import Path

import httpx
import pytest

torch = pytest.importorskip("torch")

from trt_spec.runtime.methods import Speculation  # noqa: E402
from trt_spec.runtime.sampling import SamplingParams  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
# every step drafts its k (the gain rules off): the tiny random heads are seldom accepted,
# and what the engine measured of one test's k would switch the next one's drafter off
OPTIONS = dict(max_num_seqs=10, max_model_len=96, spec_fallback=False)
PROMPTS = ["a b c a b c a b", "the cat sat on the mat the cat", "x y z"]
GREEDY = SamplingParams(max_tokens=16, ignore_eos=True)
SAMPLED = SamplingParams(max_tokens=12, temperature=0.9, top_p=0.95, seed=7, ignore_eos=True)


@pytest.fixture(scope="module")
def llms(host_and_device, tiny_vocab_engine):
    return host_and_device(tiny_vocab_engine, **OPTIONS)


@pytest.mark.parametrize("method,k", [("none", None), ("ngram", 3), ("vanilla", 2),
                                      ("mtp", 1), ("mtp", 3), ("eagle", 2), ("eagle3", 3)])
def test_greedy_output_equals_the_host_executors(llms, method, k):
    host, device = (llms[e].generate(PROMPTS, GREEDY, method=method, num_draft_tokens=k,
                                     chat=False) for e in ("host", "device"))
    assert [o.token_ids for o in device] == [o.token_ids for o in host]
    assert all(len(o.token_ids) == 16 for o in device)
    assert {(o.metrics.executor, o.metrics.fallback) for o in device} == {("device", None)}
    assert {o.metrics.executor for o in host} == {"host"}
    if method != "none":
        assert sum(o.metrics.proposed_tokens for o in device) > 0


@pytest.mark.parametrize("control", [{"logit_bias": {7: 4.0, 9: -50.0}},
                                     {"repetition_penalty": 1.6}, {"presence_penalty": 1.5},
                                     {"frequency_penalty": 0.8},
                                     {"min_p": 0.2, "temperature": 0.8, "seed": 3}])
def test_the_sampling_controls_on_the_device_equal_the_host_executors(llms, control):
    """The controls apply on the device to every verified row (runtime/device/controls.py):
    greedy output under them equals the host executor's, speculative (mtp, k 3) or not; the
    output tokens count for the penalties. min_p with sampling: its first token (the race
    at position 0, shared by both executors) shows the same filter."""
    params = SamplingParams(**{"max_tokens": 12, "ignore_eos": True, **control})
    for method, k in (("none", None), ("mtp", 3)):
        host, device = (llms[e].generate(PROMPTS, params, method=method, num_draft_tokens=k,
                                         chat=False) for e in ("host", "device"))
        assert {o.metrics.executor for o in device} == {"device"}
        if params.greedy:
            assert [o.token_ids for o in device] == [o.token_ids for o in host], method
        else:
            assert [o.token_ids[0] for o in device] == [o.token_ids[0] for o in host]
    plain = llms["host"].generate(PROMPTS, SamplingParams(max_tokens=12, ignore_eos=True),
                                  chat=False)
    if params.greedy:  # the control changed something
        assert [o.token_ids for o in plain] != [o.token_ids for o in device]


@pytest.mark.parametrize("method,k", [("none", None), ("eagle3", 3)])
def test_logprobs_on_the_device_equal_the_host_executors(llms, method, k):
    """The target's rows of the emitted tokens come back for a request that asks (the same
    logits as the host's: its logprobs, top-n and ranks)."""
    params = SamplingParams(max_tokens=10, logprobs=3, ignore_eos=True)
    host, device = (llms[e].generate(PROMPTS, params, method=method, num_draft_tokens=k,
                                     chat=False) for e in ("host", "device"))
    for h, d in zip(host, device):
        assert d.metrics.executor == "device" and d.token_ids == h.token_ids
        assert len(d.logprobs) == len(d.token_ids) == 10
        for a, b in zip(d.logprobs, h.logprobs):
            assert (a.token_id, a.rank, [t for t, _ in a.top]) == \
                (b.token_id, b.rank, [t for t, _ in b.top])
            assert a.logprob == pytest.approx(b.logprob, abs=1e-4)


def run(llm, specs):
    """Every (prompt, params, method, k) queued at once and stepped to the end -> (the
    requests, the step reports)."""
    sched = llm.scheduler
    requests = sched.enqueue_all([sched.prepare(llm.tokenizer.encode(p), params, Speculation(m, k))
                                  for p, params, m, k in specs])
    reports = []
    while not all(c.done for r in requests for c in r.choices):
        reports.append(sched.step())
    return requests, reports


MIXED = [  # (prompt, params, method, k) -> the executor, and why the host where it is
    (PROMPTS[0], GREEDY, "mtp", 3, "device", None),
    (PROMPTS[1], GREEDY, "ngram", 2, "device", None),
    (PROMPTS[2], SamplingParams(max_tokens=8, logprobs=2), "mtp", 3, "device", None),
    (PROMPTS[2], SamplingParams(max_tokens=8, prompt_logprobs=1), "mtp", 3, "device", None),
    (PROMPTS[0], SamplingParams(max_tokens=8, logit_bias={7: 3.0}), "eagle3", 2, "device",
     None),
    (PROMPTS[1], SamplingParams(max_tokens=8, n=2, ignore_eos=True), "eagle3", 2, "device",
     None),
    (PROMPTS[2], SamplingParams(max_tokens=0), "mtp", 3, "device", None),
    (PROMPTS[0], GREEDY, "mtp", "auto", "device", None),
    (PROMPTS[1], GREEDY, "suffix", 2, "device", None),
    (PROMPTS[2], SamplingParams(max_tokens=8, min_tokens=4, bad_words_ids=((7,), (9, 9))),
     "ngram", 2, "device", None),
    # a fifth method while the four loops above are busy: the host steps it beside them
    (PROMPTS[0], GREEDY, "vanilla", 2, "host", "all busy"),
]


def test_a_batch_mixing_features_keeps_each_requests_path(llms):
    specs = [x[:4] for x in MIXED]
    device, reports = run(llms["device"], specs)
    host, _ = run(llms["host"], specs)
    for r, h, (*_, executor, why) in zip(device, host, MIXED):
        for c, hc in zip(r.choices, h.choices):
            s = c.stream
            assert s.output_ids == hc.stream.output_ids, (s.method, s.params)
            assert s.finish_reason == hc.stream.finish_reason
            assert s.executor == executor and (why is None) == (s.fallback is None), s.fallback
            assert why is None or why in s.fallback
            assert len(s.sources) == len(s.output_ids)
        assert len(r.choices) == r.stream.params.n
    assert device[2].stream.logprobs and device[6].stream.output_ids == []
    fallbacks = {}
    for rep in reports:
        for why, n in (rep.engine.fallbacks.items() if rep.engine else ()):
            fallbacks[why] = fallbacks.get(why, 0) + n
    assert sum(fallbacks.values()) == sum(x[-1] is not None for x in MIXED)
    # the two executors stepped in the same scheduler steps
    assert any(rep.engine and 0 < rep.engine.device_streams < rep.engine.decode_streams
               for rep in reports)


def test_the_device_loops_stay_bounded(llms):
    """One loop (caches, graphs) per method, whatever k: past MAX_LOOPS busy ones a request
    runs on the host, saying why; an idle loop makes room for a new one."""
    from trt_spec.runtime.device.loop import MAX_LOOPS

    keys = [("mtp", 1), ("mtp", 3), ("eagle", 2), ("ngram", 2), ("eagle3", 1), ("none", None),
            ("eagle", 3)]
    requests, _ = run(llms["device"], [(PROMPTS[0], GREEDY, m, k) for m, k in keys])
    executors = [r.stream.executor for r in requests]
    assert len({r.stream.method for r in requests if r.stream.executor == "device"}) == MAX_LOOPS
    assert executors.count("device") == 6 and "host" in executors  # mtp and eagle: 2 k each
    assert all("all busy" in r.stream.fallback for r in requests if r.stream.executor == "host")
    assert len({r.stream.output_ids == requests[0].stream.output_ids for r in requests}) == 1
    s = llms["device"].generate(PROMPTS[:1], GREEDY, method="vanilla", num_draft_tokens=1,
                                chat=False)[0]
    assert s.metrics.executor == "device"


def test_sampled_output_on_the_device_repeats_with_its_seed(llms):
    a, b = (llms["device"].generate(PROMPTS[:1], SAMPLED, method="eagle3",
                                    num_draft_tokens=3, chat=False)[0] for _ in range(2))
    assert a.token_ids == b.token_ids and len(a.token_ids) == 12
    assert a.metrics.executor == "device"


@pytest.mark.parametrize("method,k", [("none", None), ("mtp", 3)])
def test_seeded_sampled_output_equals_the_host_executors(llms, method, k):
    host, device = (llms[e].generate(PROMPTS, SAMPLED, method=method, num_draft_tokens=k,
                                     chat=False) for e in ("host", "device"))
    assert [o.metrics.executor for o in device] == ["device"] * 3
    assert [o.token_ids for o in device] == [o.token_ids for o in host]


def test_the_server_takes_the_executor_option(tiny_vocab_engine, llms):
    from tests.server_util import start_server

    want = llms["host"].generate(PROMPTS[:1], GREEDY, method="mtp", num_draft_tokens=3,
                                 chat=False)[0]
    server = start_server(tiny_vocab_engine, "--backend", "torch-cuda", "--device", "cpu",
                          "--executor", "device", "--method", "mtp", timeout=120)
    try:
        body = {"model": "tiny", "prompt": PROMPTS[0], "max_tokens": 16, "temperature": 0,
                "ignore_eos": True, "speculative": {"method": "mtp", "num_draft_tokens": 3}}
        out = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).json()
        assert out["choices"][0]["text"] == want.text
        assert out["metrics"]["executor"] == "device", out["metrics"]
        body["speculative"] = {"method": "suffix", "num_draft_tokens": 3}  # host drafts
        out = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).json()
        assert out["choices"][0]["text"] == want.text
        assert out["metrics"]["executor"] == "device", out["metrics"]
        assert out["metrics"].get("executor_fallback") is None, out["metrics"]
    finally:
        server.stop()


def test_no_module_outside_the_executors_builds_an_admission_loop():
    """Admission (a KV slot for a stream: Engine.admit) happens in runtime/executors.py,
    which the scheduler calls; nothing else loops over streams admitting them (the device
    loop's own `run` is gone)."""
    allowed = {ROOT / "runtime/executors.py"}
    bad = []
    for folder in ("runtime", "serve", "tools", "trt_spec"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                        and node.func.attr == "admit" and path not in allowed:
                    target = ast.unparse(node.func.value)
                    if "engine" in target:
                        bad.append(f"{path.relative_to(ROOT)}:{node.lineno} {target}.admit")
                if isinstance(node, ast.While) and "free_slots" in ast.unparse(node.test):
                    bad.append(f"{path.relative_to(ROOT)}:{node.lineno} while ...free_slots")
    assert not bad, bad
