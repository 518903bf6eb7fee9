"""History as it came: a chat's earlier answer sent back in `messages` in every shape the
server itself returns (whole and streamed-assembled, with reasoning and with tool calls, and
as the openai client dumps it) is a 200, with the prompt of its plain form: its reasoning
reaches a template that renders it and nothing else; refusal, name, content null beside
tool_calls and content as text parts are read as OpenAI means them."""

from __future__ import annotations

import json
from types import SimpleNamespace

import httpx
import pytest

from tests.server_util import start_server
from trt_spec.runtime import validation
from trt_spec.runtime.tool_calls import FORMATS, OPEN, CLOSE, tools
from trt_spec.runtime.chat import PLAIN, Reading
from trt_spec.serve.chat import ChatShape, ToolChatShape

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object",
                                          "properties": {"city": {"type": "string"}}}}}
# the tiny tokenizer's template, but an assistant's reasoning shown between "t" words
RENDERS_REASONING = (
    "{% for m in messages %}<|im_start|> {{ m['role'] }} {% if m.reasoning_content %}t "
    "{{ m.reasoning_content }} t {% endif %}{{ m['content'] }} <|im_end|> {% endfor %}"
    "{% if add_generation_prompt %}<|im_start|> assistant {% endif %}")
ANSWER = "<think> x y </think> c d"  # what the model wrote (the shapes split it)
CALL = OPEN + json.dumps({"name": "get_weather", "arguments": {"city": "o"}}) + CLOSE


def out(text, finish=None):
    return SimpleNamespace(text=text, logprobs=[], finish_reason=finish)


def job(text):
    return SimpleNamespace(stream=SimpleNamespace(text=text, logprobs=[], finish_reason="stop"))


def assembled(shape, pieces: list[str]) -> dict:
    """The message a client assembles from the streamed chunks of `pieces` (the openai
    client's way: strings concatenated, tool calls by index)."""
    deltas = [shape.opening()["delta"]]
    deltas += [shape.delta(None, out(p))["delta"] for p in pieces]
    deltas.append(shape.delta(None, out("", "stop"))["delta"])
    message = {}
    for d in deltas:
        for key, value in d.items():
            if key == "tool_calls":
                calls = message.setdefault("tool_calls", [])
                for c in value:
                    calls.append(c)
            elif isinstance(value, str):
                message[key] = message.get(key, "") + value if key != "role" else value
    return message


def server_shapes() -> dict[str, dict]:
    """Each answer's message as the server returns it (serve/chat.py's shapes, thinking on:
    the template has a think section), whole and streamed-assembled."""
    def plain():
        return ChatShape(None, False, Reading(FORMATS["block"], [], False, False))

    def with_tools():
        return ToolChatShape(None, False, Reading(FORMATS["block"], tools([WEATHER]), False,
                                                  False))

    cut = [ANSWER[:9], ANSWER[9:15], ANSWER[15:]]
    called = "<think> x y </think> c d " + CALL
    return {
        "whole": plain().whole(job(ANSWER))["message"],
        "streamed": assembled(plain(), cut),
        "whole, calls": with_tools().whole(job(called))["message"],
        "streamed, calls": assembled(with_tools(), [called[:20], called[20:]]),
        "whole, no thinking": ChatShape(None, False, PLAIN).whole(job("c d"))["message"],
    }


@pytest.fixture(scope="module")
def server(tiny_engine, tmp_path_factory):
    template = tmp_path_factory.mktemp("history") / "template.jinja"
    template.write_text(RENDERS_REASONING)
    s = start_server(tiny_engine, "--chat-template", str(template), "--max-model-len", "256")
    yield s
    assert s.stop() == 0


def prompt_of(server, history: dict) -> list[int]:
    """The prompt's token ids the server reads for [user, history, user] (but its first)."""
    messages = [{"role": "user", "content": "a b"}, history, {"role": "user", "content": "e"}]
    r = httpx.post(f"{server.url}/v1/chat/completions", timeout=60, json={
        "model": "tiny", "messages": messages, "max_tokens": 0, "prompt_logprobs": 0})
    assert r.status_code == 200, (history, r.text)
    return [int(next(iter(e))) for e in r.json()["prompt_logprobs"][1:]]


def tokens(server, text: str) -> list[int]:
    r = httpx.post(f"{server.url}/tokenize", json={"prompt": text, "add_special_tokens": False})
    return r.json()["tokens"][1:]


def test_the_shapes_are_what_the_server_returns():
    shapes = server_shapes()
    assert shapes["whole"] == shapes["streamed"] == {
        "role": "assistant", "content": "c d", "reasoning_content": " x y "}
    whole, streamed = shapes["whole, calls"], shapes["streamed, calls"]
    assert whole["reasoning_content"] == streamed["reasoning_content"] == " x y "
    assert [c["function"] for c in whole["tool_calls"]] == \
        [c["function"] for c in streamed["tool_calls"]]
    assert "index" in streamed["tool_calls"][0] and "index" not in whole["tool_calls"][0]


def client_dumps(message: dict) -> list[dict]:
    """The message as the openai client hands it back: its ChatCompletionMessage dumped
    whole (every field, null ones too) and as it came (exclude_unset)."""
    from openai.types.chat import ChatCompletionMessage

    parsed = ChatCompletionMessage.model_validate(message)
    return [parsed.model_dump(), parsed.model_dump(exclude_unset=True)]


def test_every_shape_the_server_returns_comes_back_with_the_expected_prompt(server):
    reasoned = prompt_of(server, {"role": "assistant", "content": "c d",
                                  "reasoning_content": " x y "})
    # the template renders the reasoning: the earlier turn's thinking is in the prompt
    assert reasoned == tokens(server, "<|im_start|> user a b <|im_end|> <|im_start|> "
                                      "assistant t x y t c d <|im_end|> <|im_start|> user e "
                                      "<|im_end|> <|im_start|> assistant")
    plain = prompt_of(server, {"role": "assistant", "content": "c d"})
    calls = prompt_of(server, server_shapes()["whole, calls"])
    # a call turn: the reasoning, then the text with the call as the model wrote it
    written = OPEN + '{"name": "get_weather", "arguments": {"city": "o"}}' + CLOSE
    assert calls == tokens(server, "<|im_start|> user a b <|im_end|> <|im_start|> assistant t "
                                   f"x y t c d\n{written} <|im_end|> <|im_start|> user e "
                                   "<|im_end|> <|im_start|> assistant")
    for name, message in server_shapes().items():
        expected = (calls if "calls" in name else
                    plain if "no thinking" in name else reasoned)
        for shape in [message, *client_dumps(message)]:
            assert prompt_of(server, shape) == expected, (name, shape)
    # vLLM's newer name for the reasoning, and content as text parts
    assert prompt_of(server, {"role": "assistant", "content": "c d", "reasoning": " x y "}) \
        == reasoned
    assert prompt_of(server, {"role": "assistant", "reasoning_content": " x y ", "content": [
        {"type": "text", "text": "c"}, {"type": "text", "text": " d"}]}) == reasoned
    # a refusal is what the assistant said; a name is kept; content null beside calls
    assert prompt_of(server, {"role": "assistant", "content": None, "refusal": "c d"}) == plain
    assert prompt_of(server, {"role": "assistant", "content": "c d", "name": "bot"}) == plain
    call = server_shapes()["whole, calls"]
    assert prompt_of(server, {**call, "content": None, "reasoning_content": None}) == \
        prompt_of(server, {**call, "content": "", "reasoning_content": None})


def test_a_template_that_does_not_render_reasoning_drops_it(tmp_path):
    from tests.tiny_tokenizer import save_tiny_tokenizer
    from trt_spec.runtime.generator import encode_prompt
    from trt_spec.runtime.tokenizer import Tokenizer

    save_tiny_tokenizer(tmp_path, 128)
    tok = Tokenizer(tmp_path)
    base = [{"role": "user", "content": "a b"}]
    for message in server_shapes().values():
        if "tool_calls" in message:
            continue
        assert encode_prompt(tok, [*base, message]) == \
            encode_prompt(tok, [*base, {"role": "assistant", "content": "c d"}])


def test_what_an_answer_never_carries_is_still_a_400():
    bad = [
        ({"role": "assistant", "content": "c", "audio": {"id": "x"}}, "messages[0].audio"),
        ({"role": "assistant", "content": "c", "function_call": {"name": "f"}},
         "messages[0].function_call"),
        ({"role": "assistant", "content": "c", "reasoning_content": 3},
         "messages[0].reasoning_content"),
        ({"role": "user", "content": "c", "reasoning_content": "x"},
         "messages[0].reasoning_content"),
        ({"role": "user", "content": None}, "messages[0].content"),
        ({"role": "user"}, "messages[0]"),
        ({"role": "assistant", "content": "c", "nope": 1}, "messages[0].nope"),
    ]
    for message, field in bad:
        with pytest.raises(validation.FieldError) as e:
            validation.chat([message])
        assert e.value.field == field, (message, e.value.field)
    # a chat checked twice stays the same (the Python API checks what the server checked)
    shapes = [m for m in server_shapes().values()]
    once = validation.chat(shapes)
    assert validation.chat(once) == once
