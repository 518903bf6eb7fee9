"""Reasoning models (runtime/reasoning.py): the thinking section apart from the answer, the
chat template's kwargs passed through and checked, structures held after the thinking, and
the chat endpoint's reasoning_content (streamed and not) and --reasoning-in-content."""

from __future__ import annotations

import json
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


def guide_accepts(folder, grammar: str, text: str) -> tuple[bool, bool]:
    """(every token of `text` valid, the grammar complete after it) on the tokenizer of
    `folder` (SmolLM2's)."""
    from llguidance import LLMatcher, LLTokenizer

    from trt_spec.runtime.grammar import limits
    from trt_spec.runtime.tokenizer import Tokenizer

    tok = Tokenizer(folder)
    llt = LLTokenizer(tok.to_json(), n_vocab=tok.vocab_size, eos_token=[tok.eos_token_id])
    text_g = LLMatcher.grammar_from_lark(grammar)
    assert not LLMatcher.validate_grammar_with_warnings(text_g, llt, limits=limits())[0]
    m = LLMatcher(llt, text_g, log_level=0)
    ids = tok.encode(text, add_special_tokens=False)
    n = m.validate_tokens(ids)
    for t in ids[:n]:
        m.consume_token(t)
    return n == len(ids), m.is_accepting()


def test_structures_start_after_the_thinking_section(smollm2_hf_dir):
    from trt_spec.runtime.sampling import SamplingParams
    from trt_spec.runtime.tool_calls import FORMATS, ToolChoice, tools

    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    weather = {"type": "function", "function": {"name": "w", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
    call = '<tool_call>\n{"name": "w", "arguments": {"city": "Oslo"}}\n</tool_call>'
    cases = [  # each structure: (SamplingParams, an answer it holds, one it refuses)
        (SamplingParams(json_schema=schema), '{"a": 1}', '{"a": "x"}'),
        (SamplingParams(regex=r"[0-9]{3}-x/y"), "123-x/y", "12-x/y"),
        (SamplingParams(grammar='start: greet " " NAME\ngreet: "hi" | "yo"\nNAME: /[a-z]+/'),
         "hi bob", "hey bob"),
        (SamplingParams(choice=("yes", "no")), "no", "maybe"),
        (SamplingParams(grammar=FORMATS["template"].grammar(
            tools([weather]), ToolChoice("required"), True)), call, "Oslo"),
    ]
    def accepts(grammar, text):
        return guide_accepts(smollm2_hf_dir, grammar, text)

    for params, good, bad in cases:
        held = reasoning.after_thinking(params)
        assert held.structure[0] == "grammar" and held.grammar.startswith('{"grammars"')
        g = held.grammar
        assert accepts(g, "<think>\nhm\n</think>\n\n" + good) == (True, True), good
        assert accepts(g, good)[0] is False  # the think block comes first
        assert accepts(g, "<think>x</think> " + bad) != (True, True), bad
        opened = reasoning.after_thinking(params, True).grammar
        assert accepts(opened, "hm\n</think>\n\n" + good) == (True, True), good
    plain = SamplingParams(temperature=0)
    assert reasoning.after_thinking(plain) is plain


# --- the chat endpoint -------------------------------------------------------------------

def test_shapes_split_reasoning_streamed_and_whole():
    from dataclasses import replace

    from trt_spec.runtime.chat import PLAIN
    from trt_spec.serve.chat import ChatShape

    def out(text, finish=None):
        return SimpleNamespace(text=text, logprobs=[], finish_reason=finish)

    shape = ChatShape(None, False, replace(PLAIN, think=False))
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
def thinking_engine(tmp_path_factory):
    """A tiny random Qwen3 (per-head q/k norms, head_dim != hidden / heads) with a Qwen3-style
    template (<think>, enable_thinking), exported fp32 with a 1-layer self-draft."""
    pytest.importorskip("transformers")
    from tests.test_families import COMMON, make_family_hf
    from tests.tiny_tokenizer import save_tiny_tokenizer
    from trt_spec.export.config import ExportConfig
    from trt_spec.export.pipeline import export_model

    hf = make_family_hf(tmp_path_factory.mktemp("qwen3-thinking"), "qwen3")
    save_tiny_tokenizer(hf, COMMON["vocab_size"], thinking=True)
    return export_model(ExportConfig(str(hf), tmp_path_factory.mktemp("engines") / "think",
                                     "fp32", draft_layers=1))


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


# --- the Python API ----------------------------------------------------------------------

def test_llm_chat_holds_structures_after_the_thinking_on_every_method(thinking_engine):
    """LLM.chat on the tiny Qwen3: a structure starts after the think block (a bias on
    </think> closes it at once: the random model would think on), greedy output is the same
    for every method, and a prompt that opened the block is read as such."""
    from trt_spec import LLM, SamplingParams

    llm = LLM(thinking_engine, max_num_seqs=2)
    close = llm.tokenizer.encode("</think>", add_special_tokens=False)
    assert len(close) == 1
    chat = [{"role": "user", "content": "a b c"}]
    # (the tiny tokenizer's words carry no spaces: "xy" is the tokens x, y, decoded "x y")
    held = SamplingParams(temperature=0, max_tokens=12, choice=("xy", "z"),
                          logit_bias={close[0]: 100})
    free = SamplingParams(temperature=0, max_tokens=12)
    seen = {}
    for method in llm.methods:
        k = None if method == "none" else 3
        out = [llm.chat(chat, p, method=method, num_draft_tokens=k)[0].outputs[0]
               for p in (held, free)]
        assert out[0].reasoning_content is not None and out[0].text.startswith("<think>")
        assert reasoning.split(out[0].text)[1] in ("x y", "z"), out[0].text
        assert out[0].finish_reason == "stop", out[0]
        seen[method] = [(o.text, o.reasoning_content) for o in out]
    assert len(set(map(str, seen.values()))) == 1, seen
    # the template opened the think block: the output starts inside it
    opened = llm.chat(chat, held, chat_template_kwargs={"open_thinking": True})[0].outputs[0]
    assert not opened.text.lstrip().startswith("<think>")
    assert opened.reasoning_content is not None
    assert reasoning.split(opened.text, True)[1] in ("x y", "z"), opened.text
    assert opened.finish_reason == "stop", opened
    # thinking off: the structure holds the output from its first token
    off = llm.chat(chat, held, chat_template_kwargs={"enable_thinking": False})[0].outputs[0]
    assert off.reasoning_content is None and off.text in ("x y", "z"), off.text
    assert off.finish_reason == "stop", off


def test_the_chat_endpoint_holds_guided_fields_after_the_thinking(servers):
    split, _ = servers
    import httpx

    close = httpx.post(f"{split.url}/tokenize", json={"prompt": "</think>",
                                                      "add_special_tokens": False},
                       timeout=60).json()["tokens"]
    # (the tiny tokenizer's words carry no spaces: "zy" is the tokens z, y, decoded "z y")
    for field, value in (("guided_choice", ["xy", "z"]), ("guided_regex", "(x|z)y"),
                         ("guided_grammar", 'start: "z" ("x" | "y")')):
        r = post(split, response_format=None, max_tokens=12, logit_bias={str(close[0]): 100},
                 **{field: value})
        assert r.status_code == 200, r.text
        message = r.json()["choices"][0]["message"]
        assert message["reasoning_content"] is not None, (field, message)
        assert message["content"] in ("x y", "z y", "z x", "z"), (field, message)
        assert r.json()["choices"][0]["finish_reason"] == "stop", (field, r.json())
