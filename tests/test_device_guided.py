"""Structured outputs and prompt logprobs on the device executor (runtime/device/masks.py,
runtime/device/prompt_logprobs.py), through `LLM` on the CPU torch backend: the host's
grammar masks each verified row on the device, so the output under a regex, grammar, choice or
JSON schema equals the host executor's for every method the device runs, greedy and seeded
sampled; the prefill's prompt logprobs equal the host's. Each such request runs on the
device (no fallback).

The tiny models' tokenizer is word-level (tests/tiny_tokenizer.py): the grammar sees its
tokens' text concatenated, so the languages are spelled in its single letters."""

import json
import re

import pytest

torch = pytest.importorskip("torch")

from trt_spec.runtime.methods import Speculation  # noqa: E402
from trt_spec.runtime.sampling import SamplingParams  # noqa: E402

# (spec_fallback off: drafts on every step, so every step masks drafted rows)
OPTIONS = dict(max_num_seqs=8, max_model_len=64, spec_fallback=False)
PROMPTS = ["a b c a b c a b", "the cat sat on the mat", "x y z"]
METHODS = [("none", None), ("ngram", 3), ("vanilla", 2), ("mtp", 3), ("eagle", 2),
           ("eagle3", 3)]
STRUCTURES = {
    "regex": {"regex": "(ab|xy)c(d|fg|h)+e"},
    "grammar": {"grammar": 'start: "p" x x x\nx: "a" | "b" "q" | "c" x'},
    "choice": {"choice": ["rst", "uv", "q", "rsu"]},
    "json_schema": {"json_schema": json.dumps({"type": "boolean"})},
}


@pytest.fixture(scope="module")
def llms(host_and_device, tiny_vocab_engine):
    return host_and_device(tiny_vocab_engine, **OPTIONS)


def both(llms, params, method="none", k=None):
    return [llms[e].generate(PROMPTS, params, method=method, num_draft_tokens=k, chat=False)
            for e in ("host", "device")]


def on_device(outputs) -> bool:
    return {(o.metrics.executor, o.metrics.fallback) for o in outputs} == {("device", None)}


@pytest.mark.parametrize("method,k", METHODS)
def test_greedy_output_under_every_structure_equals_the_host_executors(llms, method, k):
    for kind, structure in STRUCTURES.items():
        params = SamplingParams(max_tokens=14, **structure)
        host, device = both(llms, params, method, k)
        assert on_device(device), kind
        assert [o.token_ids for o in device] == [o.token_ids for o in host], (method, kind)
        assert [o.finish_reason for o in device] == [o.finish_reason for o in host]
        assert any(len(o.token_ids) > 1 for o in device), kind


def run(llm, specs):
    """Every (prompt, params, method, k) queued at once and stepped to the end -> (the
    streams (choice 0 of each request), the steps' metrics)."""
    sched = llm.scheduler
    requests = sched.enqueue_all([sched.prepare(llm.tokenizer.encode(p), params, Speculation(m, k))
                                  for p, params, m, k in specs])
    steps = []
    while not all(c.done for r in requests for c in r.choices):
        steps.append(sched.step().engine)
    return [r.choices[0].stream for r in requests], [m for m in steps if m is not None]


def test_a_batch_mixing_guided_and_free_requests_keeps_each_ones_output(llms):
    """Guided and unguided streams of one loop step together (the unguided rows: all ones);
    the regex's loop is taken, the output is in its language, and an unguided request keeps
    its own, unmasked output."""
    regex = SamplingParams(max_tokens=20, **STRUCTURES["regex"])
    choice = SamplingParams(max_tokens=20, **STRUCTURES["choice"])
    free = SamplingParams(max_tokens=10, ignore_eos=True)
    specs = [(PROMPTS[0], regex, "mtp", 3), (PROMPTS[1], free, "mtp", 3),
             (PROMPTS[2], choice, "mtp", 3), (PROMPTS[1], regex, "mtp", 3)]
    (device, steps), (host, _) = run(llms["device"], specs), run(llms["host"], specs)
    assert [s.output_ids for s in device] == [s.output_ids for s in host]
    assert {(s.executor, s.fallback) for s in device} == {("device", None)}
    for s in (device[0], device[3]):
        assert s.finish_reason == "stop" and len(s.output_ids) > 5
        assert re.fullmatch("(ab|xy)c(d|fg|h)+e", s.text.replace(" ", "")), s.text
    assert device[2].text.replace(" ", "") in STRUCTURES["choice"]["choice"]
    assert len(device[1].output_ids) == 10 and device[1].guide is None
    assert sum(s.stats.proposed for s in device) > 0
    assert sum(m.mask_s for m in steps) > 0 and all(s.metrics().masks for s in device[::2])


@pytest.mark.parametrize("method,k", [("none", None), ("ngram", 3), ("eagle3", 3),
                                      ("vanilla", 2)])
def test_seeded_sampled_output_under_a_structure_equals_the_host_executors(llms, method, k):
    for kind in ("regex", "grammar"):
        params = SamplingParams(max_tokens=14, temperature=1.0, seed=11, top_p=0.95,
                                **STRUCTURES[kind])
        host, device = both(llms, params, method, k)
        assert on_device(device)
        assert [o.token_ids for o in device] == [o.token_ids for o in host], (method, kind)


def test_controls_and_logprobs_under_a_structure_equal_the_host_executors(llms):
    """The mask first, then the controls (as the host); logprobs report the raw rows."""
    params = SamplingParams(max_tokens=12, logprobs=2, logit_bias={10: 3.0},
                            repetition_penalty=1.3, **STRUCTURES["regex"])
    host, device = both(llms, params, "eagle", 2)
    assert on_device(device)
    for h, d in zip(host, device):
        assert d.token_ids == h.token_ids
        for a, b in zip(d.logprobs, h.logprobs):
            assert a.token_id == b.token_id and a.rank == b.rank
            assert [t for t, _ in a.top] == [t for t, _ in b.top]
            assert a.logprob == pytest.approx(b.logprob, abs=1e-4)


@pytest.mark.parametrize("method,k", [("none", None), ("mtp", 3)])
def test_prompt_logprobs_on_the_device_equal_the_host_executors(llms, method, k):
    for n, max_tokens in ((3, 6), (0, 4), (2, 0)):
        params = SamplingParams(max_tokens=max_tokens, prompt_logprobs=n, ignore_eos=True)
        host, device = both(llms, params, method, k)
        assert on_device(device)
        for h, d in zip(host, device):
            assert d.token_ids == h.token_ids
            assert len(d.prompt_logprobs) == len(h.prompt_logprobs) == len(d.prompt_token_ids)
            assert d.prompt_logprobs[0] is None and h.prompt_logprobs[0] is None
            for a, b in zip(d.prompt_logprobs[1:], h.prompt_logprobs[1:]):
                assert (a.token_id, a.rank) == (b.token_id, b.rank)
                assert [t for t, _ in a.top] == [t for t, _ in b.top]
                assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
                for (_, x), (_, y) in zip(a.top, b.top):
                    assert x == pytest.approx(y, abs=1e-4)


def test_a_model_drafters_first_draft_is_held_to_the_grammar(llms):
    """After "f" the JSON boolean's grammar allows "a" only: a first draft held to it is
    accepted, where an unheld one of a random head would almost never be."""
    params = SamplingParams(max_tokens=8, **STRUCTURES["json_schema"])
    host, device = both(llms, params, "mtp", 3)
    assert [o.token_ids for o in device] == [o.token_ids for o in host]
    assert {o.text.replace(" ", "") for o in device} <= {"true", "false"}
    assert all(o.metrics.accepted_tokens >= 1 for o in device)


def test_the_server_runs_a_structure_and_prompt_logprobs_on_the_device(tiny_vocab_engine,
                                                                        llms):
    """`serve --executor device`: a completion under guided_regex with prompt_logprobs has
    the host executor's text and prompt logprobs, and says it ran on the device."""
    import httpx

    from tests.server_util import start_server

    params = SamplingParams(max_tokens=16, prompt_logprobs=2, **STRUCTURES["regex"])
    want = llms["host"].generate(PROMPTS[:1], params, method="mtp", num_draft_tokens=3,
                                 chat=False)[0]
    server = start_server(tiny_vocab_engine, "--backend", "torch-cuda", "--device", "cpu",
                          "--executor", "device", "--method", "mtp", timeout=120)
    try:
        body = {"model": "tiny", "prompt": PROMPTS[0], "max_tokens": 16, "temperature": 0,
                "guided_regex": STRUCTURES["regex"]["regex"], "prompt_logprobs": 2,
                "speculative": {"method": "mtp", "num_draft_tokens": 3}}
        out = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).json()
    finally:
        server.stop()
    choice = out["choices"][0]
    assert choice["text"] == want.text
    assert (out["metrics"]["executor"], out["metrics"]["executor_fallback"]) == ("device", None)
    got = choice["prompt_logprobs"]
    assert got[0] is None and len(got) == len(want.prompt_logprobs)
    for entry, lp in zip(got[1:], want.prompt_logprobs[1:]):
        assert entry[str(lp.token_id)]["rank"] == lp.rank
        assert entry[str(lp.token_id)]["logprob"] == pytest.approx(lp.logprob, abs=1e-4)


def test_the_device_unpacks_the_bitmasks_as_the_host_applies_them():
    """Every bit, the sign bit included, over a vocabulary that ends mid-word: -inf on the
    device where the host's Guide.apply adds -inf."""
    import numpy as np

    from trt_spec.runtime.device.masks import DeviceMasks
    from trt_spec.runtime.grammar import Guide

    vocab, width = 70, 3
    masks = DeviceMasks(slots=2, width=width, vocab=vocab, device="cpu")
    rng = np.random.default_rng(0)
    bits = rng.integers(-2**31, 2**31, size=(2, width, masks.words), dtype=np.int64)
    bits[0, 0] = -1
    bits[1, 1] = np.int32(-2**31)  # only bit 31 of each word
    masks.bits.copy_(torch.from_numpy(bits.astype(np.int32)))
    logits = rng.normal(size=(2, width, vocab)).astype(np.float32)
    got = masks.apply(torch.from_numpy(logits), 0).numpy()
    guide = Guide.__new__(Guide)
    guide.mask_s = 0.0
    for b in range(2):
        want = logits[b].copy()
        guide.apply(want, bits[b].astype(np.int32))
        np.testing.assert_array_equal(np.isinf(got[b]), np.isinf(want))
        np.testing.assert_array_equal(got[b][~np.isinf(got[b])], want[~np.isinf(want)])
