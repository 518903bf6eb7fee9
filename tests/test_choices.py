"""n > 1: a request's n choices read the prompt once (choice i > 0 starts from choice 0's
prompt rows), draw with seed + i, are admitted to the queue whole or refused, and come back
as RequestOutput.outputs."""

import pytest

from trt_spec import LLM, SamplingParams
from trt_spec.runtime.generator import Generator
from trt_spec.runtime.scheduler import QueueFull, Scheduler, generate_ids
from trt_spec.runtime.validation import FieldError

PROMPT = [42, 8, 77, 61, 23, 11, 90, 8, 77, 5, 17, 99]
SAMPLED = SamplingParams(max_tokens=12, temperature=1.0, seed=7, ignore_eos=True)


def prefill_tokens(sched: Scheduler, params: SamplingParams, prompt=PROMPT) -> tuple[int, list]:
    """(prompt tokens the target read, the choices) for one request run to the end."""
    read = []
    sched.on_step = lambda report: read.append(report.engine.prefill_tokens
                                               if report.engine else 0)
    r = sched.enqueue(sched.prepare(prompt, params))
    while not all(c.done for c in r.choices):
        sched.step()
    return sum(read), r.choices


@pytest.mark.parametrize("method", ["none", "ngram", "vanilla"])
@pytest.mark.parametrize("prefix_cache", [True, False])
def test_the_prompt_is_read_once(tiny_spec_engine, method, prefix_cache):
    """Choices 1..n-1 copy choice 0's prompt rows and read only its last token, with the
    prefix cache or without; each choice is the answer a request seeded seed + i gets."""
    gen = Generator(tiny_spec_engine, method=method, max_batch=4, prefix_cache=prefix_cache)
    read, choices = prefill_tokens(Scheduler(gen), SamplingParams(**{**vars(SAMPLED), "n": 3}))
    assert read == len(PROMPT) + 2
    assert [c.index for c in choices] == [0, 1, 2]
    assert [c.stream.stats.cached_tokens for c in choices] == [0] + [len(PROMPT) - 1] * 2
    outputs = [c.stream.output_ids for c in choices]
    for i, out in enumerate(outputs):
        alone = SamplingParams(**{**vars(SAMPLED), "seed": SAMPLED.seed + i})
        assert out == generate_ids(Generator(tiny_spec_engine, method=method), [PROMPT],
                                   alone)[0].output_ids
    assert len({tuple(o) for o in outputs}) > 1  # different draws
    assert gen.cache.free_slots == 4


def test_a_choice_admitted_later_starts_from_choice_0(tiny_spec_engine):
    """Two slots, one taken by another request: choice 1 waits for a slot, then copies the
    rows of choice 0, still running (prefix cache off: nothing else would give them)."""
    gen = Generator(tiny_spec_engine, max_batch=2, prefix_cache=False)
    sched = Scheduler(gen)
    other = sched.submit([4, 4], SamplingParams(max_tokens=3, ignore_eos=True))
    params = SamplingParams(max_tokens=20, temperature=1.0, seed=1, n=2, ignore_eos=True)
    r = sched.submit(PROMPT, params)
    sched.step()
    assert r.stream.slot is not None and r.choices[1].stream.slot is None  # no slot yet
    while not all(c.done for c in r.choices):
        sched.step()
    assert other.done and r.choices[1].stream.stats.cached_tokens == len(PROMPT) - 1
    alone = SamplingParams(**{**vars(params), "n": 1, "seed": 2})
    assert r.choices[1].stream.output_ids == generate_ids(
        Generator(tiny_spec_engine), [PROMPT], alone)[0].output_ids
    with pytest.raises(FieldError, match=r"n=3: at most 2 choices per request "
                                         r"\(--max-num-seqs 2; each choice decodes"):
        sched.prepare(PROMPT, SamplingParams(**{**vars(params), "n": 3}))


def test_a_choice_whose_source_ends_during_prefill_reads_the_prompt_itself(tiny_spec_engine):
    """Choice 0 cancelled while its prompt is read in chunks: the others read it whole."""
    gen = Generator(tiny_spec_engine, max_batch=3, max_prefill_tokens=4, prefix_cache=False)
    sched = Scheduler(gen)
    r = sched.enqueue(sched.prepare(PROMPT, SamplingParams(max_tokens=3, n=2,
                                                           ignore_eos=True)))
    sched.step()  # admitted; 4 prompt tokens of choice 0 read, choice 1 waits on it
    assert r.choices[1].stream.fork_of is r.stream
    gen.engine.release(r.stream, keep=False)
    r.stream.finish_reason = "abort"
    assert r.choices[1].stream.fork_of is None
    while not r.choices[1].done:
        sched.step()
    greedy = generate_ids(Generator(tiny_spec_engine), [PROMPT], SamplingParams(
        max_tokens=3, ignore_eos=True))[0].output_ids
    assert r.choices[1].stream.output_ids == greedy


def test_the_queue_bound_counts_every_choice(tiny_engine):
    gen = Generator(tiny_engine, max_batch=4, max_waiting=3)
    sched = Scheduler(gen)
    sched.submit(PROMPT, SamplingParams(max_tokens=2, n=2))
    with pytest.raises(QueueFull, match=r"2 requests are already waiting \(the bound is 3; "
                                        r"this one has 2 choices\)"):
        sched.submit(PROMPT, SamplingParams(max_tokens=2, n=2))
    assert sched.num_waiting == 2  # nothing of the refused request was queued
    with pytest.raises(FieldError, match=r"n=4: at most 3 choices per request "
                                         r"\(--max-num-seqs 4, --max-waiting 3"):
        sched.prepare(PROMPT, SamplingParams(max_tokens=2, n=4))


def test_llm_returns_n_outputs(tiny_spec_engine):
    llm = LLM(tiny_spec_engine, method="vanilla", num_draft_tokens=3, max_num_seqs=4)
    params = SamplingParams(**{**vars(SAMPLED), "n": 3})
    first, second = llm.generate(["a b c", "d e"], params)
    assert [o.index for o in first.outputs] == [0, 1, 2] and len(second.outputs) == 3
    assert first.text == first.outputs[0].text and first.finished
    again = llm.generate(["a b c", "d e"], params)
    assert [o.token_ids for o in again[0].outputs] == [o.token_ids for o in first.outputs]
    greedy = llm.generate("a b c", SamplingParams(max_tokens=8, n=2, ignore_eos=True))[0]
    assert greedy.outputs[0].token_ids == greedy.outputs[1].token_ids
    with pytest.raises(ValueError, match="n=2: stream"):
        next(llm.stream("a b c", SamplingParams(n=2)))
    with pytest.raises(ValueError, match="n=2: generate / generate_ids answer each prompt once"):
        generate_ids(llm.generator, [PROMPT], SamplingParams(n=2))
    assert llm.scheduler.num_running == 0 and llm.generator.cache.free_slots == 4


def test_each_choice_holds_to_the_structure_with_its_own_guide(tiny_spec_engine):
    """A grammar's matcher state is per stream: every choice gets its own guide."""
    pytest.importorskip("llguidance")
    llm = LLM(tiny_spec_engine, method="vanilla", max_num_seqs=3)
    params = SamplingParams(max_tokens=8, temperature=1.0, seed=3, n=3,
                            choice=["rst", "uv", "q"], logit_bias={5: 2.0})
    out = llm.generate("a b", params, chat=False)[0]
    assert all(o.text.replace(" ", "") in ("rst", "uv", "q") for o in out.outputs), out.outputs
    assert all(o.finish_reason == "stop" for o in out.outputs)
