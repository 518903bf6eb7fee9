"""Structured outputs (runtime/grammar.py): the output held to a regex, grammar, choice or JSON
schema on every method, speculative output equal to plain decoding under the same grammar,
grammar-forced tokens drafted for free, and bad structures refused with their reason.

The tiny models' tokenizer is word-level: the grammar sees its tokens' text concatenated
(`words`), so the languages below are spelled in its single letters (a..z: a word wN would be
a dead end after the letter w, which no real tokenizer has)."""

import re

import numpy as np
import pytest

from trt_spec.runtime.generator import Generator
from trt_spec.runtime.provenance import step_sources
from trt_spec.runtime.sampling import SamplingParams
from trt_spec.runtime.scheduler import generate_ids

REGEX = "(ab|xy)c(d|fg|h)+e"
FORCED = "(ab|xy)cdefghijk(l|m)"  # after its first token, ten tokens allowed one way only
PROMPTS = [[5, 6, 7], [9, 10, 11, 12], [20, 21]]


def words(gen: Generator, ids: list[int]) -> str:
    return "".join(gen.tokenizer.token_bytes(t).decode() for t in ids)


def held(gen: Generator, s, pattern: str) -> bool:
    """s's output is in the language (finished by the grammar) or a prefix of a word in it
    (cut by max_tokens)."""
    text = words(gen, s.output_ids)
    if s.finish_reason == "stop":
        return re.fullmatch(pattern, text) is not None
    return s.finish_reason == "length" and not s.guide.matcher.is_error()


def test_every_method_holds_to_the_regex_and_greedy_output_equals_plain(tiny_heads_engine):
    outputs = {}
    for forced in (0, 8):
        gen = Generator(tiny_heads_engine, max_batch=3, forced_tokens=forced, fallback=False)
        for method in gen.methods:
            streams = generate_ids(gen, PROMPTS, SamplingParams(max_tokens=24, regex=REGEX),
                                       method, None if method == "none" else 3)
            assert all(held(gen, s, REGEX) for s in streams), (method, forced)
            outputs[method, forced] = [s.output_ids for s in streams]
    assert len({m for m, _ in outputs}) >= 6, outputs.keys()  # none, lookups and the heads
    plain = outputs["none", 0]
    assert any(len(o) > 3 for o in plain)  # the grammar's loop was taken, not only its end
    assert all(o == plain for o in outputs.values()), outputs


def test_forced_tokens_are_drafted_for_free_and_change_nothing(tiny_spec_engine):
    params = SamplingParams(max_tokens=16, regex=FORCED)
    runs = {}
    for forced in (0, 8):
        gen = Generator(tiny_spec_engine, forced_tokens=forced)
        runs[forced] = generate_ids(gen, PROMPTS[:1], params, "none")[0]
        assert held(gen, runs[forced], FORCED) and runs[forced].finish_reason == "stop"
    off, on = runs[0], runs[8]
    assert on.output_ids == off.output_ids and len(off.output_ids) == 12
    assert off.stats.target_forwards == 12  # one token per forward
    # the first token, then the ten forced ones as drafts (8, then 2), then the last
    assert on.stats.target_forwards <= 4 and on.stats.drafted_by.get("grammar")
    m = on.metrics()
    assert m.masks >= m.completion_tokens and m.mask_s > 0


def test_a_grammar_and_a_choice_hold_the_output(tiny_spec_engine):
    gen = Generator(tiny_spec_engine, max_batch=2)
    grammar = 'start: "p" x x\nx: "a" | "b" "q"'
    for params, pattern in [(SamplingParams(max_tokens=8, grammar=grammar), "p(a|bq){2}"),
                            (SamplingParams(max_tokens=8, choice=["rst", "uv", "q"]),
                             "rst|uv|q")]:
        for method in ("none", "ngram", "vanilla"):
            for s in generate_ids(gen, PROMPTS[:2], params, method,
                                      None if method == "none" else 2):
                assert s.finish_reason == "stop", (method, s.output_ids)
                assert re.fullmatch(pattern, words(gen, s.output_ids)), (method, s.output_ids)


def test_sampled_output_holds_to_the_grammar_on_every_method(tiny_heads_engine):
    gen = Generator(tiny_heads_engine, max_batch=3, fallback=False)
    for method in gen.methods:
        for seed in range(4):
            params = SamplingParams(max_tokens=20, regex=REGEX, temperature=1.0, seed=seed)
            for s in generate_ids(gen, PROMPTS, params, method,
                                      None if method == "none" else 3):
                assert held(gen, s, REGEX), (method, seed, s.output_ids)


@pytest.mark.parametrize("field, value, reason", [
    ("regex", "(unclosed", "regex does not compile"),
    ("grammar", "start: nowhere", "grammar does not compile"),
    ("json_schema", {"type": "nonsense"}, "json_schema does not compile"),
    ("json_schema", "{not json", "json_schema='{not json': not JSON"),
    ("choice", ["yes", ""], "non-empty strings"),
])
def test_a_bad_structure_is_refused_with_its_reason(tiny_engine, field, value, reason):
    gen = Generator(tiny_engine)
    with pytest.raises(ValueError, match=re.escape(reason)):
        generate_ids(gen, [[5, 6]], SamplingParams(**{field: value}))


def test_one_structure_per_request_and_a_size_bound():
    with pytest.raises(ValueError, match="regex and choice are given"):
        SamplingParams(regex="a", choice=["b"])
    with pytest.raises(ValueError, match="at most 65536 are accepted"):
        SamplingParams(regex="a" * 70_000)


def test_the_device_executor_holds_a_grammar_too(tiny_engine):
    """(tests/test_device_guided.py: every structure and method against the host executor)"""
    pytest.importorskip("torch")
    gen = Generator(tiny_engine, backend="torch-cuda", device="cpu", cuda_graphs=False,
                    executor="device")
    s = generate_ids(gen, [[5, 6]], SamplingParams(max_tokens=4, regex="ab"))[0]
    assert s.executor == "device" and s.fallback is None and s.metrics().fallback is None
    assert words(gen, s.output_ids) == "ab" and s.finish_reason == "stop"


def test_a_row_with_nothing_allowed_allows_eos_which_ends_the_stream_in_error(tiny_engine):
    """Where the grammar allows nothing (a dead end, or the matcher past one of its limits),
    the row allows EOS only, which the grammar then refuses: append ends the stream with
    finish_reason "error" instead of sampling from a row of -inf."""
    gen = Generator(tiny_engine)
    guide = gen.grammars.guide(SamplingParams(regex="ab"))
    z = gen.tokenizer.encode("z", add_special_tokens=False)[0]
    assert not guide.consume(z)  # the matcher is now in its error state
    bits = guide.masks([])
    eos = sorted(gen.stops.eos_ids)
    allowed = [t for t in range(gen.config.vocab_size) if bits[0, t // 32] >> (t % 32) & 1]
    assert allowed == eos
    s = gen.stream([5, 6], SamplingParams(regex="ab"))
    s.guide = guide
    from trt_spec.runtime.stream import append

    append(s, [eos[0]], gen.stops, np.zeros((1, gen.config.vocab_size), np.float32),
           step_sources(1, None, 0, 0, 1))
    assert s.finish_reason == "error"
