"""Steps near the end of the context: every row of a step is padded to its widest request,
after each slot's cached tokens (idle slots of the step's range too), so a stream close to
max_len beside a long prompt chunk would not fit the cache. The step then runs one request
at a time (StepGraph.step): every request gets the output it gets alone, none fails."""

import numpy as np
import pytest

from trt_spec import LLM, SamplingParams
from trt_spec.runtime.step_inputs import SlotTokens, fits

MAX_LEN = 64


@pytest.fixture(scope="module")
def llm(tiny_engine):
    return LLM(str(tiny_engine), max_model_len=MAX_LEN, max_num_seqs=4)


def ids(seed: int, n: int) -> list[int]:
    return np.random.default_rng(seed).integers(3, 120, n).tolist()


def test_an_idle_slot_near_the_end_beside_a_long_chunk(llm):
    gen = llm.scheduler.gen
    cache, target = gen.cache, gen.engine.target
    cache.lengths[:] = 0
    target.step(cache, [SlotTokens(1, ids(0, MAX_LEN - 6), [])])  # slot 1: 6 rows left
    requests = [SlotTokens(0, ids(1, 10), [9]), SlotTokens(2, ids(2, 1), [0])]
    assert not fits(cache, requests)  # slot 1 (idle) has no room for 10 padded columns
    out = target.step(cache, requests)
    assert cache.lengths.tolist()[:3] == [10, MAX_LEN - 6, 1]
    for slot, req, got in zip((0, 2), requests, out.logits):  # each as it is alone
        cache.lengths[slot] = 0
        alone = target.step(cache, [req]).logits[0]
        np.testing.assert_allclose(got, alone, rtol=1e-5, atol=1e-5)
    cache.lengths[:] = 0


def test_a_stream_at_the_edge_beside_one_that_drafts(tiny_spec_engine):
    """One stream a few tokens from max_len decodes beside one that verifies 4 drafts a
    step: the step's rows are 5 wide, more than the first stream's slot has left."""
    llm = LLM(str(tiny_spec_engine), method="vanilla", num_draft_tokens=4,
              max_model_len=MAX_LEN, max_num_seqs=2)
    sch = llm.scheduler
    edge, short = ids(20, MAX_LEN - 6), ids(21, 4)
    params = SamplingParams(max_tokens=5, ignore_eos=True)

    def run(*prompts):
        requests = [sch.submit(p, params) for p in prompts]
        while sch.has_work():
            sch.step()
        assert all(r.error is None for r in requests), [r.error for r in requests]
        return [r.stream.output_ids for r in requests]

    together = run(edge, short)
    assert together == run(edge) + run(short)
