"""The Python API: `from trt_spec import LLM, SamplingParams`, and the README's example."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.no_torch import run_without_torch
from trt_spec import LLM, SamplingParams
from trt_spec.runtime.generator import Generator
from trt_spec.runtime.scheduler import generate

README = Path(__file__).resolve().parents[1] / "README.md"
GREEDY = SamplingParams(max_tokens=16, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_spec_engine):
    return LLM(tiny_spec_engine, method="ngram", num_draft_tokens=3, max_num_seqs=3)


def readme_example() -> str:
    section = README.read_text().split("## Python API", 1)[1]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_readme_example_runs(tiny_spec_engine):
    code = readme_example().replace('"engines/smollm2-135m"', repr(str(tiny_spec_engine)))
    assert repr(str(tiny_spec_engine)) in code  # the example names the engine it loads
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    # two outputs, the streamed text, then the answer held to a JSON schema (which the tiny
    # model's word-level tokenizer cannot spell: tests/test_structured_smollm2.py checks JSON)
    assert len(lines) == 4
    for line in lines[:2]:
        assert re.search(r" (stop|length) \d+ tokens, tau \d\.\d\d, acceptance by position:",
                         line), line


def test_generate_equals_the_generator(llm, tiny_spec_engine):
    prompts = ["a b c", [{"role": "user", "content": "d e f"}], "g h i j"]
    outs = llm.generate(prompts, GREEDY, chat=False)
    gen = Generator(tiny_spec_engine)
    want = generate(gen, prompts, GREEDY, chat=False)
    assert [o.token_ids for o in outs] == [w.token_ids for w in want]
    assert [o.text for o in outs] == [w.text for w in want]
    for o, p in zip(outs, prompts):
        assert o.prompt == p and o.finished and o.finish_reason == "length"
        assert o.outputs[0].text == o.text and o.outputs[0].index == 0
        assert o.prompt_token_ids == gen.encode(p, chat=False)
        m = o.metrics
        assert m.method == "ngram" and m.num_draft_tokens == 3
        assert m.tau >= 1.0 and m.completion_tokens == 16
        assert len(m.acceptance_per_position) <= 3


def test_prompt_forms(llm):
    chat = [{"role": "user", "content": "a b"}]
    one = llm.generate("a b", GREEDY)
    assert len(one) == 1 and len(llm.generate(chat, GREEDY)) == 1
    # a plain string goes through the chat template when the model has one
    assert one[0].token_ids == llm.generate(chat, GREEDY)[0].token_ids
    assert one[0].prompt_token_ids != llm.generate("a b", GREEDY, chat=False)[0].prompt_token_ids


def test_per_call_method_is_lossless(llm, tiny_spec_engine):
    prompts = ["a b c d", "e f"]
    base = [o.token_ids for o in llm.generate(prompts, GREEDY, method="none")]
    for method, k in [("vanilla", 2), ("ngram", None), ("vanilla", None)]:
        outs = llm.generate(prompts, GREEDY, method=method, num_draft_tokens=k)
        assert [o.token_ids for o in outs] == base
        assert outs[0].metrics.method == method
    # the gain rules skip a drafter measured not to pay (the tiny one): with them off it drafts
    every_step = LLM(tiny_spec_engine, method="ngram", num_draft_tokens=3, spec_fallback=False)
    out = every_step.generate(prompts, GREEDY, method="vanilla")
    assert [o.token_ids for o in out] == base and out[0].metrics.proposed_tokens > 0


def test_stream_equals_generate(llm):
    full = llm.generate("a b c", GREEDY)[0]
    deltas = list(llm.stream("a b c", GREEDY))
    assert len(deltas) > 1 and "".join(deltas) == full.text
    # a stop string: the stream ends where generate's text was cut
    word = full.text.split()[4]
    params = SamplingParams(max_tokens=16, ignore_eos=True, stop=[word])
    cut = llm.generate("a b c", params)[0]
    assert cut.finish_reason == "stop" and word not in cut.text
    assert "".join(llm.stream("a b c", params)) == cut.text


def test_leaving_a_stream_early_frees_its_slot(llm):
    for delta in llm.stream("a b c", SamplingParams(max_tokens=100, ignore_eos=True)):
        assert llm.scheduler.slots_used == 1
        break
    assert llm.scheduler.slots_used == 0 and not llm.scheduler.has_work()


@pytest.mark.parametrize("kwargs, message", [
    (dict(backend="tpu"), "backend='tpu': expected auto or one of ort, torch-cuda, trt"),
    (dict(backend="trt"), "backend 'trt' needs TensorRT"),
    (dict(method="eagle3"), "has no eagle3 drafter (export it with --eagle3 CHECKPOINT); "
                            "methods here: none, vanilla, ngram, suffix, hybrid"),
    (dict(num_draft_tokens=0, method="ngram"), "num_draft_tokens=0"),
])
def test_bad_arguments(tiny_spec_engine, kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        LLM(tiny_spec_engine, **kwargs)


def test_bad_prompt_queues_nothing(llm):
    with pytest.raises(ValueError, match="the prompt has 300 tokens"):
        llm.generate(["a b", " ".join(["a"] * 300)], GREEDY, chat=False)
    assert not llm.scheduler.has_work()


def test_api_and_server_import_without_torch(tiny_engine):
    """The runtime-only install can use the API and build the server (no torch)."""
    run_without_torch(f"""
        from trt_spec import LLM, SamplingParams
        from trt_spec.serve.server import create_app
        llm = LLM({str(tiny_engine)!r})
        out = llm.generate("a b", SamplingParams(max_tokens=3, ignore_eos=True))[0]
        assert len(out.token_ids) == 3
        create_app(llm.scheduler, "tiny", start_loop=False)
    """)


@pytest.mark.slow
def test_streaming_utf8_with_the_real_tokenizer(smollm2_engine):
    """SmolLM2's byte-level BPE splits CJK and emoji across tokens: fed one token at a time,
    the detokenizer still hands out whole characters only."""
    from trt_spec.runtime.detokenizer import IncrementalDetokenizer

    llm = LLM(smollm2_engine, max_num_seqs=1)
    text = "naïve café, 日本語の文章, 🎉🦀 ok"
    ids = llm.tokenizer.encode(text, add_special_tokens=False)
    assert any("\ufffd" in llm.tokenizer.decode([i]) for i in ids)  # some token is a partial char
    d = IncrementalDetokenizer(llm.tokenizer)
    deltas = []
    for n in range(1, len(ids) + 1):
        d.update(ids[:n])
        deltas.append(d.delta())
    assert "".join(deltas) + d.flush(text) == text
    assert not any("\ufffd" in x for x in deltas)
    prompt = "Repeat exactly: naïve café 日本語 🎉"
    params = SamplingParams(max_tokens=40)
    streamed = list(llm.stream(prompt, params))
    assert "".join(streamed) == llm.generate(prompt, params)[0].text
    assert not any("\ufffd" in x for x in streamed)
