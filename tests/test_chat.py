"""A chat's orchestration (runtime/chat.py), which LLM.chat and the server's chat endpoint
both run: the options checked with errors naming the field, the params held to the call
grammar and after the thinking section, and the answer read back."""

from __future__ import annotations

import json

import pytest

from tests.tiny_tokenizer import save_tiny_tokenizer
from trt_spec.runtime import reasoning
from trt_spec.runtime.chat import Chat
from trt_spec.runtime.sampling import SamplingParams
from trt_spec.runtime.tokenizer import Tokenizer
from trt_spec.runtime.tool_calls import OPEN, CLOSE
from trt_spec.runtime.validation import FieldError

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object",
                                          "properties": {"city": {"type": "string"}}}}}
CHAT = [{"role": "user", "content": "a b"}]


@pytest.fixture(scope="module")
def thinking(tmp_path_factory) -> Tokenizer:
    folder = tmp_path_factory.mktemp("thinking")
    save_tiny_tokenizer(folder, 100, thinking=True)
    return Tokenizer(folder)


def held(tok, params=SamplingParams(), **options):
    chat = Chat.of(tok, **options)
    return chat.hold(chat.encode(CHAT), params)


def test_forced_calls_are_held_after_the_thinking_section(thinking):
    chat = Chat.of(thinking, [WEATHER], "required")
    calls = chat.fmt.grammar(chat.tools, chat.choice, True, {})
    params, reading = chat.hold(chat.encode(CHAT), SamplingParams())
    assert params.grammar == reasoning.thinking_first(calls, False)
    assert reading.held and reading.think is False and [t.name for t in reading.tools] == \
        ["get_weather"]
    # the prompt opened the think block: the grammar starts inside it
    params, reading = held(thinking, tools=[WEATHER], tool_choice="required",
                           chat_template_kwargs={"open_thinking": True})
    assert reading.think is True and params.grammar == reasoning.thinking_first(calls, True)
    # thinking off (reasoning_effort none): the call grammar itself, and nothing to split
    params, reading = held(thinking, tools=[WEATHER], tool_choice="required",
                           reasoning_effort="none")
    assert params.grammar == calls and reading.think is None


def test_a_structure_is_held_after_the_thinking_section_and_auto_leaves_it(thinking):
    schema = {"type": "object"}
    params, reading = held(thinking, SamplingParams(json_schema=json.dumps(schema)),
                           tools=[WEATHER])
    assert params.structure[0] == "grammar" and not reading.held and reading.tools
    assert held(thinking, tool_choice=None)[0] == SamplingParams()  # no structure: as given
    assert held(thinking, tools=[WEATHER], tool_choice="none")[1].tools == []


def test_the_answer_reads_as_reasoning_content_and_calls(thinking):
    _, reading = held(thinking, tools=[WEATHER])
    call = f'{OPEN}{{"name": "get_weather", "arguments": {{"city": "Oslo"}}}}{CLOSE}'
    thought, content, calls = reading.read(f"<think> hm </think> ok {call}")
    assert thought == " hm " and content == "ok" and \
        [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Oslo"})]
    assert reading.read("plain") == (None, "plain", None)  # it did not think
    _, plain = held(thinking, reasoning_effort="none")
    assert plain.read(f"x {call}") == (None, f"x {call}", None)  # no tools: no calls


@pytest.mark.parametrize("options, params, field", [
    ({"tools": [WEATHER], "tool_choice": "required"}, SamplingParams(regex="a+"), "tool_choice"),
    ({"tool_choice": "required"}, SamplingParams(), "tool_choice"),
    ({"tools": [{"type": "function"}]}, SamplingParams(), "tools[0]"),
    ({"chat_template_kwargs": {"messages": []}}, SamplingParams(), "chat_template_kwargs"),
    ({"reasoning_effort": "huge"}, SamplingParams(), "reasoning_effort"),
    ({"continue_final_message": True, "add_generation_prompt": True}, SamplingParams(),
     "continue_final_message"),
    ({"documents": "text"}, SamplingParams(), "documents"),
])
def test_errors_name_the_field(thinking, options, params, field):
    with pytest.raises(FieldError) as e:
        held(thinking, params, **options)
    assert e.value.field == field, str(e.value)


def test_a_structure_error_names_the_callers_field(thinking):
    chat = Chat.of(thinking, [WEATHER], "required")
    ids = chat.encode(CHAT)
    with pytest.raises(FieldError, match="sampling_params.regex"):
        chat.hold(ids, SamplingParams(regex="a+"))
    with pytest.raises(FieldError, match="held to guided_regex"):
        chat.hold(ids, SamplingParams(regex="a+"), "guided_regex")


def test_rendering_follows_vllms_fields(thinking):
    assert Chat.of(thinking).rendering == {"add_generation_prompt": True}
    go_on = Chat.of(thinking, continue_final_message=True, documents=[{"text": "d"}])
    assert go_on.rendering == {"add_generation_prompt": False, "continue_final_message": True,
                               "documents": [{"text": "d"}]}
    last = [*CHAT, {"role": "assistant", "content": "c d"}]
    text = thinking.decode(go_on.encode(last), skip_special_tokens=False)
    assert text.rstrip().endswith("c d")  # the last message left open
    effort = Chat.of(thinking, reasoning_effort="low", chat_template_kwargs={"x": 1})
    assert effort.variables == {"enable_thinking": True, "reasoning_effort": "low", "x": 1}
