"""Each output token's origin (runtime/provenance.py): an accepted draft and its drafter, the
grammar, or the target. The counts add up to the completion and agree with the request's
metrics on every method, and the Python API hands them out whole and streamed."""

from __future__ import annotations

import pytest

from trt_spec.runtime import provenance
from trt_spec.runtime.methods import METHODS
from trt_spec.runtime.provenance import TokenSource, drafter_source, step_sources

PROMPT = "a b c d a b c d a b c d a b"


def test_each_drafter_names_its_source():
    expected = {"ngram": "lookup", "suffix": "lookup", "vanilla": "draft", "mtp": "head",
                "eagle": "head", "eagle3": "head"}
    assert {m: drafter_source(m) for m in expected} == expected
    # every method that drafts by itself has a source (hybrid, auto draft as their picks)
    assert set(expected) == {m for m in METHODS if METHODS[m].make is not None
                             and m not in ("hybrid", "auto")}
    assert drafter_source("grammar") == "grammar"
    assert drafter_source("suffix", corpus=True) == "corpus"


def test_a_steps_tokens_are_its_accepted_drafts_then_the_targets():
    got = step_sources(5, "mtp", 3, 2, 3)
    assert [t.source for t in got] == ["head", "head", "target"]
    assert [t.position for t in got] == [1, 2, 3] and {t.step for t in got} == {5}
    assert all(t.drafter == "mtp" and t.drafted == 3 for t in got)
    assert step_sources(0, None, 0, 0, 1) == [TokenSource("target", None, 0, 1, 0)]
    # a step that drafted nothing names no drafter, whatever its method
    assert step_sources(2, "ngram", 0, 0, 1)[0].drafter is None
    # cut by a stop condition: fewer tokens, the same order
    assert [t.source for t in step_sources(1, "ngram", 4, 4, 2)] == ["lookup", "lookup"]


def check_adds_up(out, metrics, method: str) -> None:
    """Accepted draft tokens plus target tokens are the completion; with no stop condition
    cutting a step short (ignore_eos, drafts cut to the room left) they are the metrics'."""
    sources = out.token_sources
    assert len(sources) == len(out.token_ids) == metrics.completion_tokens, method
    n = provenance.counts(sources)
    assert sum(n.values()) == len(sources)
    assert len(sources) - n["target"] == metrics.accepted_tokens, (method, n, metrics)
    assert n["target"] == metrics.target_forwards, (method, n, metrics)
    steps = {}
    for t in sources:
        steps.setdefault(t.step, []).append(t)
    assert sorted(steps) == list(range(len(steps)))
    for tokens in steps.values():
        assert [t.position for t in tokens] == list(range(1, len(tokens) + 1))
        assert tokens[-1].source == "target"
        own = [t for t in tokens[:-1] if t.source != "grammar" or t.drafter == "grammar"]
        assert len(own) <= tokens[0].drafted  # (a forced run after the drafts: grammar)
        assert {t.drafter for t in tokens} == {tokens[0].drafter}
    drafters = {t.drafter for t in sources if t.drafter}
    assert drafters == set(metrics.drafted_by), (method, drafters, metrics.drafted_by)


@pytest.fixture(scope="module")
def llm(tiny_heads_engine):
    from trt_spec import LLM

    return LLM(tiny_heads_engine, max_num_seqs=2, max_model_len=96)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_the_counts_add_up_on_every_method(llm, temperature):
    from trt_spec import SamplingParams

    params = SamplingParams(max_tokens=24, temperature=temperature, seed=3, ignore_eos=True)
    seen = set()
    for method in llm.methods:
        k = None if method == "none" else 3
        out = llm.generate(PROMPT, params, method=method, num_draft_tokens=k)[0]
        check_adds_up(out.outputs[0], out.metrics, method)
        seen |= {t.source for t in out.outputs[0].token_sources}
        if method == "none":
            assert {t.source for t in out.outputs[0].token_sources} == {"target"}
    assert "lookup" in seen  # the repeating prompt: the lookups are accepted


def test_grammar_forced_tokens_are_marked_apart(llm):
    from trt_spec import SamplingParams

    # (the tiny tokenizer's words carry no spaces: a..g are seven tokens)
    params = SamplingParams(max_tokens=24, temperature=0, choice=("abcdefg",))
    for method in ("none", "ngram"):
        out = llm.generate(PROMPT, params, method=method,
                           num_draft_tokens=None if method == "none" else 3)[0]
        sources = out.outputs[0].token_sources
        assert "grammar" in {t.source for t in sources}, sources
        assert all(t.drafter == "grammar" for t in sources if t.source == "grammar")


def test_stream_details_hands_out_the_same_sources(llm):
    from trt_spec import SamplingParams, StreamDelta

    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    whole = llm.generate(PROMPT, params, method="ngram", num_draft_tokens=3)[0].outputs[0]
    deltas = list(llm.stream(PROMPT, params, method="ngram", num_draft_tokens=3, details=True))
    assert all(isinstance(d, StreamDelta) for d in deltas)
    assert [t for d in deltas for t in d.token_ids] == whole.token_ids
    streamed = [s for d in deltas for s in d.token_sources]
    # (the policy's k follows what it measured, so the two runs' origins may differ)
    assert len(streamed) == len(whole.token_ids) and streamed[0].step == 0
    assert all(b.step == a.step and b.position == a.position + 1 or
               b.step == a.step + 1 and b.position == 1 for a, b in zip(streamed, streamed[1:]))
    assert "".join(d.text for d in deltas) == whole.text
    assert deltas[-1].finish_reason == "length" and not any(d.finish_reason
                                                            for d in deltas[:-1])
    # plain stream keeps yielding text
    assert "".join(llm.stream(PROMPT, params, method="ngram", num_draft_tokens=3)) == whole.text
