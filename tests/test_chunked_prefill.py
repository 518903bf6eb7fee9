"""Chunked prefill and logprobs on tiny engines: a step reads at most max_prefill_tokens
prompt tokens, streams already decoding emit a token every step meanwhile, and greedy outputs
(every method) and their logprobs are those of unchunked prefill; a token's logprob is the
log-softmax of the target's logits, with speculation or without."""

import numpy as np
import pytest

from trt_spec.runtime.stream import Stream
from trt_spec.runtime.generator import Generator
from trt_spec.runtime.settings import SpeculationConfig
from trt_spec.runtime.sampling import SamplingParams
from trt_spec.runtime.scheduler import Scheduler
from trt_spec.runtime.step_inputs import SlotTokens

RNG = np.random.default_rng(0)
PROMPTS = [RNG.integers(3, 128, n).tolist() for n in (61, 5, 33)]
GREEDY = SamplingParams(max_tokens=12, ignore_eos=True, logprobs=3)


def run(gen: Generator, method: str, budget: int | None, prompts=PROMPTS, params=GREEDY):
    sched = Scheduler(gen.configure(method=method, num_draft_tokens=3,
                                    max_prefill_tokens=budget))
    reqs = [sched.submit(p, params) for p in prompts]
    steps = []
    while not all(r.done for r in reqs):
        steps.append(sched.step())
    return reqs, steps


@pytest.mark.parametrize("engine, methods", [
    ("tiny_spec_engine", ["none", "vanilla", "ngram"]),
    ("tiny_heads_engine", ["mtp", "eagle", "eagle3"]),
])
def test_chunked_prefill_equals_unchunked(engine, methods, request):
    # the same prompts run again and again: no prefix cache, so each run reads them whole
    gen = Generator(request.getfixturevalue(engine), max_batch=3, max_len=128,
                    prefix_cache=False)
    for method in methods:
        whole, _ = run(gen, method, None)
        first = None
        for budget in (1, 7, 16):
            chunked, steps = run(gen, method, budget)
            for a, b in zip(whole, chunked):
                assert b.stream.output_ids == a.stream.output_ids, (method, budget)
                # unchunked, the 33-token prompt is prefilled in one batch with the 61-token
                # one (padded to 61): its logits differ in the last bits, not its tokens
                np.testing.assert_allclose([x.logprob for x in b.stream.logprobs],
                                           [x.logprob for x in a.stream.logprobs], atol=1e-5)
            # chunks of 1, 7 or 16 tokens: the very same logits
            logprobs = [r.stream.logprobs for r in chunked]
            assert first is None or logprobs == first, (method, budget)
            first = logprobs
            prefilled = [s.engine.prefill_tokens if s.engine else 0 for s in steps]
            assert max(prefilled) <= budget
            assert sum(prefilled) == sum(len(p) for p in PROMPTS)
        assert gen.cache.free_slots == 3


def test_decoding_streams_keep_their_pace_while_a_long_prompt_is_read(tiny_engine):
    gen = Generator(tiny_engine, max_batch=2, max_len=200)
    sched = Scheduler(gen.configure(max_prefill_tokens=8))
    params = SamplingParams(max_tokens=60, ignore_eos=True)
    short = sched.submit([5, 6, 7], params)
    sched.step()
    sched.step()
    long = sched.submit(RNG.integers(3, 128, 100).tolist(), params)
    steps = 0
    while not long.stream.output_ids:
        before = len(short.stream.output_ids)
        report = sched.step()
        steps += 1
        assert len(short.stream.output_ids) == before + 1  # a token every step
        assert report.engine.prefill_tokens <= 8
    assert steps == 13  # ceil(100 / 8)
    assert long.stream.metrics().time_to_first_token_s > 0


def target_logprobs(gen: Generator, ids: list[int]) -> np.ndarray:
    """The target scoring prompt + output in one forward: log-softmax at every position."""
    slot = gen.cache.allocate()
    try:
        out = gen.target.step(gen.cache, [SlotTokens(slot, ids, list(range(len(ids))))])
    finally:
        gen.cache.release(slot)
    x = out.logits[0].astype(np.float64)
    return x - x.max(-1, keepdims=True) - np.log(np.exp(x - x.max(-1, keepdims=True))
                                                 .sum(-1, keepdims=True))


@pytest.mark.parametrize("engine, methods", [
    ("tiny_self_engine", ["vanilla"]),  # the draft is the target: every draft accepted
    ("tiny_spec_engine", ["vanilla", "ngram"]),
    ("tiny_heads_engine", ["mtp", "eagle3"]),
])
def test_logprobs_are_the_targets_with_and_without_speculation(engine, methods, request):
    gen = Generator(request.getfixturevalue(engine), max_batch=3, max_len=128)
    plain, _ = run(gen, "none", 16)
    for r in plain:
        s = r.stream
        assert len(s.logprobs) == len(s.output_ids)
        want = target_logprobs(gen, s.prompt_ids + s.output_ids)
        n = len(s.prompt_ids)
        for i, (token, lp) in enumerate(zip(s.output_ids, s.logprobs)):
            row = want[n - 1 + i]
            assert lp.token_id == token
            np.testing.assert_allclose(lp.logprob, row[token], atol=1e-4)
            assert [t for t, _ in lp.top] == list(np.argsort(-row, kind="stable")[:3])
            assert lp.top[0] == (token, lp.logprob)  # greedy: the token is the most likely
    for method in methods:
        spec, _ = run(gen, method, 16)
        if engine == "tiny_self_engine":
            assert sum(r.stream.stats.accepted for r in spec) > 20  # tokens taken from the draft
        for a, b in zip(plain, spec):
            assert b.stream.output_ids == a.stream.output_ids
            assert b.stream.logprobs == a.stream.logprobs, method  # bitwise the same


def test_no_logprobs_unless_asked(tiny_engine):
    gen = Generator(tiny_engine, max_batch=1)
    reqs, _ = run(gen, "none", 16, PROMPTS[:1], SamplingParams(max_tokens=4, ignore_eos=True))
    assert reqs[0].stream.logprobs == [] and len(reqs[0].stream.output_ids) == 4
    assert isinstance(reqs[0].stream, Stream)
