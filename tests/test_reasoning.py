"""Reasoning models (runtime/reasoning.py): the thinking section apart from the answer, the
chat template's kwargs passed through and checked, structures held after the thinking, and
the chat endpoint's reasoning_content (streamed and not) and --reasoning-in-content."""

from __future__ import annotations

import json
import shutil
from types import SimpleNamespace

import pytest

from trt_spec.runtime import reasoning
from trt_spec.runtime.validation import FieldError
from tests.tiny_tokenizer import CHAT_TEMPLATE, THINKING_TEMPLATE


def test_the_format_follows_the_template():
    assert reasoning.has_thinking(THINKING_TEMPLATE)
    assert not reasoning.has_thinking(CHAT_TEMPLATE) and not reasoning.has_thinking(None)
    assert reasoning.thinks(THINKING_TEMPLATE, {})
    assert not reasoning.thinks(THINKING_TEMPLATE, {"enable_thinking": False})
    assert not reasoning.thinks(CHAT_TEMPLATE, {})
    assert reasoning.opened("a <think>\n") and not reasoning.opened("<think>\n\n</think>\n\n")


def test_a_finished_answer_splits_at_the_closing_tag():
    split = reasoning.split
    assert split("<think>\nhm\n</think>\n\nHello") == ("\nhm\n", "Hello")
    assert split("\n<think>a</think>b") == ("a", "b")
    assert split("Hello </think> x") == (None, "Hello </think> x")  # did not think
    assert split("<think>cut short") == ("cut short", "")
    assert split("hm</think>\nok", True) == ("hm", "ok")  # the prompt opened the block
    assert split("plain") == (None, "plain")


def feed_all(pieces, opened=False):
    s = reasoning.Splitter(opened)
    out = [s.feed(p, i == len(pieces) - 1) for i, p in enumerate(pieces)]
    return out, "".join(r for r, _ in out), "".join(c for _, c in out)


def test_the_streaming_splitter_holds_back_what_may_become_a_tag():
    out, r, c = feed_all(["<th", "ink>\nhm", " </th", "ink>\n\nHel", "lo", ""])
    assert out[0] == ("", "")  # may yet open a think block
    assert out[2] == (" ", "")  # "</th" held back
    assert (r, c) == reasoning.split("<think>\nhm </think>\n\nHello")
    # a tail that only looked like a tag goes out once it is not one
    out, r, c = feed_all(["<think>a </t", "x> b", "</think>c", ""])
    assert out[1] == ("</tx> b", "") and (r, c) == ("a </tx> b", "c")
    # no thinking: content at once (but what may open a think block)
    out, r, c = feed_all(["<", "b> hi", ""])
    assert out[0] == ("", "") and out[1] == ("", "<b> hi") and r == ""
    # cut short while thinking: the held tail goes out as reasoning at the end
    assert feed_all(["<think>x </thi", ""])[1] == "x </thi"
    for pieces in (["a"], ["<think>", "z"], ["<think>z</think>", "\n", "w"]):
        _, r, c = feed_all([*pieces, ""])
        whole = reasoning.split("".join(pieces))
        assert (r, c) == (whole[0] or "", whole[1]), pieces


def test_chat_template_kwargs_are_checked_naming_the_field():
    assert reasoning.template_kwargs(None) == {}
    assert reasoning.template_kwargs({"enable_thinking": False}) == {"enable_thinking": False}
    for bad in ([1], {"": 1}, {"a b": 1}, {1: 2}, "x", {f"k{i}": 1 for i in range(40)},
                {"messages": []}, {"tools": None}, {"add_generation_prompt": False},
                {"bos_token": "x"}, {"eos_token": "x"}):
        with pytest.raises(FieldError) as e:
            reasoning.template_kwargs(bad)
        assert e.value.field == "chat_template_kwargs", bad


def test_the_kwargs_reach_the_template(tmp_path):
    from tests.tiny_tokenizer import save_tiny_tokenizer
    from trt_spec.runtime.generator import encode_prompt
    from trt_spec.runtime.tokenizer import Tokenizer

    save_tiny_tokenizer(tmp_path, 128, thinking=True)
    tok = Tokenizer(tmp_path)
    chat = [{"role": "user", "content": "a b"}]
    on, off = (tok.decode(encode_prompt(tok, chat, template_kwargs=kw), False)
               for kw in (None, {"enable_thinking": False}))
    assert "</think>" not in on and off.endswith("<think> </think>")
    assert off.startswith(on)


def guide_accepts(grammar: str, text: str) -> tuple[bool, bool]:
    """(every token of `text` valid, the grammar complete after it) on SmolLM2's tokenizer."""
    from llguidance import LLMatcher, LLTokenizer

    from trt_spec.runtime.grammar import limits
    from trt_spec.runtime.tokenizer import Tokenizer

    tok = Tokenizer("engines/smollm2-135m")
    llt = LLTokenizer(tok.to_json(), n_vocab=tok.vocab_size, eos_token=[tok.eos_token_id])
    text_g = LLMatcher.grammar_from_lark(grammar)
    assert not LLMatcher.validate_grammar_with_warnings(text_g, llt, limits=limits())[0]
    m = LLMatcher(llt, text_g, log_level=0)
    ids = tok.encode(text, add_special_tokens=False)
    n = m.validate_tokens(ids)
    for t in ids[:n]:
        m.consume_token(t)
    return n == len(ids), m.is_accepting()


def test_structures_start_after_the_thinking_section():
    from pathlib import Path

    if not Path("engines/smollm2-135m/tokenizer.json").exists():
        pytest.skip("no engines/smollm2-135m")
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    g = reasoning.json_after_thinking(schema)
    assert guide_accepts(g, '<think>\nhm\n</think>\n\n{"a": 1}') == (True, True)
    assert guide_accepts(g, '{"a": 1}')[0] is False  # the think block first
    assert guide_accepts(g, '<think>x</think> {"a": 1} y')[0] is False
    opened = reasoning.json_after_thinking(schema, True)
    assert guide_accepts(opened, 'hm\n</think>\n\n{"a": 1}') == (True, True)
    from trt_spec.runtime.tool_calls import FORMATS, ToolChoice, tools

    weather = {"type": "function", "function": {"name": "w", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
    calls = reasoning.held_after_thinking(
        FORMATS["template"].grammar(tools([weather]), ToolChoice("required"), True))
    call = '<tool_call>\n{"name": "w", "arguments": {"city": "Oslo"}}\n</tool_call>'
    assert guide_accepts(calls, "<think>so</think>\n\n" + call) == (True, True)
    assert guide_accepts(calls, call)[0] is False
    from trt_spec.runtime.sampling import SamplingParams

    p = reasoning.schema_after_thinking(SamplingParams(json_schema=schema))
    assert p.json_schema is None and p.grammar.startswith("start: think")
    plain = SamplingParams(regex="a+")
    assert reasoning.schema_after_thinking(plain) is plain


# --- the chat endpoint -------------------------------------------------------------------

def test_shapes_split_reasoning_streamed_and_whole():
    from trt_spec.serve.chat import ChatShape

    def out(text, finish=None):
        return SimpleNamespace(text=text, logprobs=[], finish_reason=finish)

    shape = ChatShape(None, False)
    shape.think = False
    second = shape.for_index(1)
    deltas = [shape.delta(None, out(t))["delta"] for t in ["<think>", " a </thi", "nk> b"]]
    assert deltas == [{}, {"reasoning_content": " a "}, {"content": "b"}]
    assert second.delta(None, out("plain", "stop"))["delta"] == {"content": "plain"}
    whole = shape.whole(SimpleNamespace(stream=SimpleNamespace(
        text="<think> a </think> b", logprobs=[], finish_reason="stop")))
    assert whole["message"] == {"role": "assistant", "content": "b",
                                "reasoning_content": " a "}
    plain = ChatShape(None, False)  # no thinking section: nothing changes
    assert plain.delta(None, out("<think> a"))["delta"] == {"content": "<think> a"}


@pytest.fixture(scope="module")
def thinking_engine(tiny_hf_dir, tmp_path_factory):
    """The tiny model with a Qwen3-style template (<think>, enable_thinking)."""
    from tests.tiny_tokenizer import save_tiny_tokenizer
    from trt_spec.export.config import ExportConfig
    from trt_spec.export.pipeline import export_model

    hf = tmp_path_factory.mktemp("tiny-thinking") / "hf"
    shutil.copytree(tiny_hf_dir, hf)
    save_tiny_tokenizer(hf, 128, thinking=True)
    return export_model(ExportConfig(str(hf), tmp_path_factory.mktemp("engines") / "think",
                                     "fp32"))


@pytest.fixture(scope="module")
def servers(thinking_engine):
    from tests.server_util import start_server

    split, kept = start_server(thinking_engine), start_server(thinking_engine,
                                                              "--reasoning-in-content")
    yield split, kept
    assert split.stop() == 0 and kept.stop() == 0


def post(server, stream=False, **body):
    import httpx

    body = {"model": "tiny", "max_tokens": 6, "temperature": 0,
            "messages": [{"role": "user", "content": "a b"}],
            # the grammar opens the think block: the random model thinks
            "response_format": {"type": "json_object"}, **body}
    if not stream:
        return httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60)
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json={**body, "stream": True},
                      timeout=60) as r:
        lines = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    return [json.loads(x) for x in lines if x != "[DONE]"]


def test_the_chat_endpoint_returns_reasoning_content(servers):
    split, kept = servers
    r = post(split)
    assert r.status_code == 200, r.text
    message = r.json()["choices"][0]["message"]
    assert message["reasoning_content"] is not None and "<think>" not in message["content"]
    chunks = post(split, stream=True)
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == \
        message["reasoning_content"]
    assert "".join(d.get("content", "") for d in deltas) == message["content"]
    whole = post(kept).json()["choices"][0]["message"]
    assert "reasoning_content" not in whole
    assert whole["content"].startswith("<think>")
    assert whole["content"] == "".join(c["choices"][0]["delta"].get("content", "")
                                       for c in post(kept, stream=True) if c["choices"])


def test_the_chat_endpoint_takes_chat_template_kwargs(servers):
    split, _ = servers
    r = post(split, response_format=None, chat_template_kwargs={"enable_thinking": False})
    assert r.status_code == 200, r.text
    assert "reasoning_content" not in r.json()["choices"][0]["message"]
    for bad in ({"messages": []}, [1], {"eos_token": "x"}):
        r = post(split, chat_template_kwargs=bad)
        assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template_kwargs"
