"""Prefill on the device executor (runtime/device/prefill.py), through `LLM` and the server on
the CPU torch backend: a prompt past max_prefill_tokens is read in chunks on the device; a
prompt that shares a kept prefix starts from those rows (a slot copy) and reports them as
cached tokens; choices 1.. of n > 1 start from choice 0's rows; max_tokens 0 reads the prompt
only. Each output equals the host executor's (greedy and seeded sampled), with its token
sources, and none falls back to the host."""

import httpx
import pytest

torch = pytest.importorskip("torch")

from trt_spec.runtime.methods import Speculation  # noqa: E402
from trt_spec.runtime.sampling import SamplingParams  # noqa: E402

OPTIONS = dict(max_num_seqs=6, max_model_len=96, max_prefill_tokens=8)
WORDS = "the cat sat on the mat and a b c a b c x y z the dog ran in the sun".split()
LONG = " ".join(WORDS * 2)  # past 8 prompt tokens: read in chunks
OTHER = " ".join(WORDS * 2 + ["z", "y", "x"])  # shares LONG's tokens but for the last one
GREEDY = SamplingParams(max_tokens=12, ignore_eos=True)
SAMPLED = SamplingParams(max_tokens=10, temperature=0.9, top_p=0.95, seed=11, ignore_eos=True)
CASES = [("none", None), ("ngram", 3), ("vanilla", 2), ("mtp", 3), ("eagle3", 3)]


@pytest.fixture(scope="module")
def llms(host_and_device, tiny_vocab_engine):
    return host_and_device(tiny_vocab_engine, **OPTIONS)


def forget(llm):
    """Empties llm's prefix cache: the host's kept slots and the device loops'."""
    llm.generator.cache.forget()
    ex = llm.generator._device_executor
    for loop in (ex.loops.values() if ex else ()):
        loop.kept.rows.clear()


def both(llms, prompts, params, method, k):
    """(host outputs, device outputs), each LLM's prefix cache emptied first."""
    outs = []
    for e in ("host", "device"):
        forget(llms[e])
        outs.append(llms[e].generate(prompts, params, method=method, num_draft_tokens=k,
                                     chat=False))
    return outs


def on_device(outputs):
    return {(o.metrics.executor, o.metrics.fallback) for o in outputs} == {("device", None)}


@pytest.mark.parametrize("method,k", CASES)
def test_a_long_prompt_is_read_in_chunks_on_the_device(llms, method, k):
    prompt_ids = llms["host"].tokenizer.encode(LONG)
    assert len(prompt_ids) > 3 * OPTIONS["max_prefill_tokens"]
    host, device = both(llms, [LONG, "x y z"], GREEDY, method, k)
    assert on_device(device)
    assert [o.token_ids for o in device] == [o.token_ids for o in host]
    sources = [[o.outputs[0].token_sources for o in out] for out in (host, device)]
    assert all(len(s) == 12 for s in sources[1])
    if k is None:  # the target's tokens alone; speculative ones name what each step accepted
        assert sources[1] == sources[0]


def test_chunks_take_several_steps_within_the_budget(llms):
    llm = llms["device"]
    sched = llm.scheduler
    r, = sched.enqueue_all([sched.prepare(llm.tokenizer.encode(LONG), GREEDY,
                                          Speculation("mtp", 2))])
    reports = []
    while not r.done:
        reports.append(sched.step())
    prefills = [rep.engine.prefill_tokens for rep in reports if rep.engine.prefill_tokens]
    assert len(prefills) > 1 and max(prefills) <= OPTIONS["max_prefill_tokens"]
    assert r.stream.executor == "device" and r.stream.fallback is None


@pytest.mark.parametrize("method,k", CASES)
def test_a_repeated_prompt_starts_from_the_kept_rows(llms, method, k):
    """The second and third prompts start from the first one's rows (kept after it ended)
    and read only the rest: cached tokens as the host counts them, the same output."""
    host, device = [], []
    for e, out in (("host", host), ("device", device)):
        forget(llms[e])
        for p in (LONG, LONG, OTHER):
            out += llms[e].generate([p], GREEDY, method=method, num_draft_tokens=k, chat=False)
    assert on_device(device)
    assert [o.token_ids for o in device] == [o.token_ids for o in host]
    cached = [o.metrics.cached_tokens for o in device]
    # the host's head drafters re-read a few rows (their catch-up: Proposer.adopt); the
    # device's catch up from the hidden rows copied with the target's
    assert all(d >= o.metrics.cached_tokens > 0 for d, o in zip(cached[1:], host[1:]))
    if k is None:
        assert cached == [o.metrics.cached_tokens for o in host]
    assert cached[0] == 0 and cached[1] == len(llms["host"].tokenizer.encode(LONG)) - 1
    assert cached[2] >= cached[1]


def test_concurrent_prompts_share_a_running_streams_rows(llms):
    """A prompt admitted while another with the same prefix runs copies the rows it has read:
    part of its prompt (mid-prefill) or all but the last token."""
    llm = llms["device"]
    forget(llm)
    sched = llm.scheduler
    ids = llm.tokenizer.encode(LONG)
    budget = OPTIONS["max_prefill_tokens"]
    first, = sched.enqueue_all([sched.prepare(ids, GREEDY, Speculation("none"))])
    sched.step()
    sched.step()  # 2 chunks read
    second, = sched.enqueue_all([sched.prepare(ids, GREEDY, Speculation("none"))])
    while not first.stream.prefilled:
        sched.step()
    third, = sched.enqueue_all([sched.prepare(ids, GREEDY, Speculation("none"))])
    while not all(r.done for r in (first, second, third)):
        sched.step()
    assert second.stream.stats.cached_tokens == 2 * budget
    assert third.stream.stats.cached_tokens == len(ids) - 1
    assert second.stream.output_ids == third.stream.output_ids == first.stream.output_ids


def run(llm, prompt: str, params: SamplingParams, method: str, k: int | None):
    """One request queued and stepped to the end -> its choices' streams."""
    sched = llm.scheduler
    forget(llm)
    r, = sched.enqueue_all([sched.prepare(llm.tokenizer.encode(prompt), params,
                                          Speculation(method, k))])
    while not all(c.done for c in r.choices):
        sched.step()
    return [c.stream for c in r.choices]


@pytest.mark.parametrize("params", [SamplingParams(max_tokens=10, n=2, ignore_eos=True),
                                    SamplingParams(max_tokens=10, n=3, temperature=0.8,
                                                   seed=5, ignore_eos=True)])
def test_choices_start_from_choice_0s_rows(llms, params):
    """Choices 1.. wait for choice 0's prompt, then copy its rows but the last (read again
    for each one's own first token), as the host's Engine.fork."""
    host, device = (run(llms[e], LONG, params, "mtp", 2) for e in ("host", "device"))
    assert [s.output_ids for s in device] == [s.output_ids for s in host]
    cached = [s.stats.cached_tokens for s in device]
    assert cached == [s.stats.cached_tokens for s in host]
    assert cached[1:] == [len(device[0].prompt_ids) - 1] * (params.n - 1)
    assert {(s.executor, s.fallback) for s in device} == {("device", None)}
    assert all(len(s.sources) == len(s.output_ids) == 10 for s in device)


@pytest.mark.parametrize("method,k", [("none", None), ("eagle3", 3)])
def test_seeded_sampled_output_equals_the_host_executors(llms, method, k):
    host, device = both(llms, [LONG, OTHER, "x y z"], SAMPLED, method, k)
    assert on_device(device)
    assert [o.token_ids for o in device] == [o.token_ids for o in host]


def test_max_tokens_0_reads_the_prompt_only(llms):
    params = SamplingParams(max_tokens=0)
    host, device = both(llms, [LONG, "x y z"], params, "mtp", 3)
    assert on_device(device)
    assert [(o.token_ids, o.finish_reason) for o in device] == [([], "length")] * 2
    assert [(o.token_ids, o.finish_reason) for o in host] == [([], "length")] * 2
    again = llms["device"].generate([LONG], GREEDY, method="mtp", num_draft_tokens=3,
                                    chat=False)[0]  # starts from the rows it read
    assert again.metrics.cached_tokens == len(llms["host"].tokenizer.encode(LONG)) - 1


def test_the_server_reports_the_devices_cached_tokens(tiny_vocab_engine, llms):
    from tests.server_util import start_server

    want = both(llms, [LONG], GREEDY, "mtp", 3)[0][0]
    server = start_server(tiny_vocab_engine, "--backend", "torch-cuda", "--device", "cpu",
                          "--executor", "device", "--method", "mtp", "--max-prefill-tokens",
                          "8", timeout=120)
    try:
        body = {"model": "tiny", "prompt": LONG, "max_tokens": 12, "temperature": 0,
                "ignore_eos": True, "speculative": {"method": "mtp", "num_draft_tokens": 3}}
        outs = [httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).json()
                for _ in range(2)]
        for out in outs:
            assert out["choices"][0]["text"] == want.text
            assert out["metrics"]["executor"] == "device", out["metrics"]
        cached = [o["usage"]["prompt_tokens_details"]["cached_tokens"] for o in outs]
        assert cached == [0, outs[0]["usage"]["prompt_tokens"] - 1]
    finally:
        server.stop()


@pytest.mark.parametrize("method,k", [("none", None), ("mtp", 3)])
def test_prompt_logprobs_of_a_chunked_prompt_equal_the_host_executors(llms, method, k):
    """A prompt read over several chunks gathers its prompt logprobs chunk by chunk (each
    chunk's rows at their own positions), equal to the host's, which chunks it alike."""
    params = SamplingParams(max_tokens=4, prompt_logprobs=2, ignore_eos=True)
    host, device = both(llms, [LONG, "x y z"], params, method, k)
    assert on_device(device)
    for h, d in zip(host, device):
        assert d.token_ids == h.token_ids
        assert len(d.prompt_logprobs) == len(h.prompt_logprobs) == len(d.prompt_token_ids)
        assert d.prompt_logprobs[0] is None
        for a, b in zip(d.prompt_logprobs[1:], h.prompt_logprobs[1:]):
            assert (a.token_id, a.rank) == (b.token_id, b.rank)
            assert [t for t, _ in a.top] == [t for t, _ in b.top]
            assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
