"""Tool calling (runtime/tool_calls.py): tools and tool turns checked, shown to the model in
its template's format, calls held to a grammar and parsed back; the chat endpoint's 400s and
its streamed holdback of a call."""

import json

import pytest

from trt_spec.runtime import tool_calls, validation
from trt_spec.runtime.tool_calls import FORMATS, OPEN, CLOSE, ToolChoice, tools
from trt_spec.runtime.tool_formats import for_template, format_of
from trt_spec.runtime.validation import FieldError
from trt_spec.runtime.chat import Reading
from trt_spec.serve.chat import ToolChatShape

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}
QWEN_LIKE = ("{%- if tools %}<|im_start|>system\n# Tools\n{% for t in tools %}{{ t | tojson }}\n"
             "{% endfor %}<|im_end|>\n{%- endif %}{% for m in messages %}<|im_start|>{{ m.role }}"
             "\n{{ m.content }}<|im_end|>\n{% endfor %}<|im_start|>assistant\n")
SMOL_LIKE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
             "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def call(name: str, **args) -> str:
    return OPEN + json.dumps({"name": name, "arguments": args}) + CLOSE


def test_tools_and_tool_choice_are_checked_naming_the_field():
    given = tools([WEATHER, TIME])
    assert [t.name for t in given] == ["get_weather", "get_time"]
    assert tool_calls.tool_choice(None, given) == ToolChoice("auto")
    assert tool_calls.tool_choice(None, []) == ToolChoice("none")
    named = tool_calls.tool_choice({"type": "function", "function": {"name": "get_time"}}, given)
    assert named == ToolChoice("function", "get_time") and named.forced
    bad = [
        (lambda: tool_calls.tool_choice({"type": "function", "function": {"name": "nope"}},
                                        given), "tool_choice", "'nope'"),
        (lambda: tool_calls.tool_choice("sometimes", given), "tool_choice", "required"),
        (lambda: tool_calls.tool_choice("required", []), "tool_choice", "needs tools"),
        (lambda: tools([WEATHER, WEATHER]), "tools", "given twice"),
        (lambda: tools([{"type": "function", "function": {"name": "a b"}}]),
         "tools[0].function.name", "letters"),
        (lambda: tools([{"type": "function", "function": {
            "name": "f", "parameters": {"type": "string"}}}]), "tools[0].function.parameters",
         "object"),
        (lambda: tools([{"type": "retrieval"}]), "tools[0]", "function"),
        (lambda: tools([]), "tools", "1..64"),
    ]
    for make, field, words in bad:
        with pytest.raises(FieldError, match=words) as e:
            make()
        assert e.value.field == field


def test_tool_turns_are_checked_and_their_arguments_parsed():
    chat = validation.chat([
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "12 C"}])
    assert chat[1] == {"role": "assistant", "content": "", "tool_calls": [
        {"id": "c1", "type": "function",
         "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]}
    assert chat[2] == {"role": "tool", "content": "12 C", "tool_call_id": "c1"}
    assert validation.chat(chat) == chat  # checked twice, the same
    with pytest.raises(FieldError, match="without tool_call_id") as e:
        validation.chat([{"role": "tool", "content": "12 C"}])
    assert e.value.field == "messages[0].tool_call_id"
    with pytest.raises(FieldError, match="not valid JSON") as e:
        validation.chat([{"role": "assistant", "content": None, "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{"}}]}])
    assert e.value.field == "messages[0].tool_calls[0].function.arguments"
    with pytest.raises(FieldError, match="only an assistant"):
        validation.chat([{"role": "user", "content": "x", "tool_calls": []}])


def test_the_format_follows_the_template_not_the_model():
    assert format_of(QWEN_LIKE).name == "template"
    assert format_of(SMOL_LIKE).name == "block" and format_of(None).name == "block"
    given = tools([WEATHER])
    msgs, variables = for_template(QWEN_LIKE, [{"role": "user", "content": "x"}],
                                              given)
    assert variables == {"tools": [WEATHER]} and msgs == [{"role": "user", "content": "x"}]


def test_the_block_format_lists_the_tools_and_renders_tool_turns():
    chat = validation.chat([
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "weather and time?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "a", "type": "function", "function": {"name": "get_weather",
                                                         "arguments": '{"city": "Oslo"}'}},
            {"id": "b", "type": "function", "function": {"name": "get_time",
                                                         "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "a", "content": "12 C"},
        {"role": "tool", "tool_call_id": "b", "content": "09:00"}])
    msgs, variables = for_template(SMOL_LIKE, chat, tools([WEATHER, TIME]))
    assert variables == {}
    assert [m["role"] for m in msgs] == ["system", "user", "assistant", "user"]
    assert msgs[0]["content"].startswith("Be brief.\n\nYou can call these tools.")
    assert '"name": "get_weather"' in msgs[0]["content"] and OPEN in msgs[0]["content"]
    assert msgs[2]["content"] == (call("get_weather", city="Oslo") + "\n" + call("get_time"))
    assert msgs[3]["content"] == ("<tool_response>\n12 C\n</tool_response>\n"
                                  "<tool_response>\n09:00\n</tool_response>")
    assert all(set(m) <= {"role", "content", "name"} for m in msgs)  # strings only


def test_calls_parse_back_and_malformed_ones_stay_text():
    fmt, given = FORMATS["block"], tools([WEATHER, TIME])
    content, calls = fmt.parse("Let me look. " + call("get_weather", city="Oslo") + "\n"
                               + call("get_time"), given)
    assert content == "Let me look."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Oslo"}), ("get_time", {})]
    assert calls[0].id.startswith("call_") and calls[0].id != calls[1].id
    for text in ["no call here", OPEN + '{"name": "get_weather", "arguments": {"city": ',
                 call("unknown"), OPEN + '{"name": "get_time", "arguments": [1]}' + CLOSE,
                 call("get_time") + " and more"]:
        assert fmt.parse(text, given) == (text, [])  # auto: the model's text, as it wrote it
    cut = call("get_time") + "\n" + call("get_weather", city="Oslo")[:30]
    assert [c.name for c in fmt.parse(cut, given, held=True)[1]] == ["get_time"]
    qwen = "<tool_call>\n" + json.dumps({"name": "get_time", "arguments": {}}) + "\n</tool_call>"
    assert [c.name for c in FORMATS["template"].parse(qwen, given)[1]] == ["get_time"]


def test_the_call_grammar_compiles_and_holds_each_call_to_its_schema():
    from llguidance import LLMatcher

    given = tools([WEATHER, TIME])
    for fmt in FORMATS.values():
        for choice, parallel in [(ToolChoice("required"), True), (ToolChoice("required"), False),
                                 (ToolChoice("function", "get_time"), False)]:
            lark = fmt.grammar(given, choice, parallel)
            assert not LLMatcher.validate_grammar(LLMatcher.grammar_from_lark(lark)), lark
            assert ("get_weather" in lark) == (choice.mode == "required")
            assert lark.startswith('start: call ("\\n" call)*' if parallel else "start: call\n")
    schema = tool_calls.call_schema(given[0])
    assert schema["properties"]["name"] == {"const": "get_weather"}
    assert schema["properties"]["arguments"] == WEATHER["function"]["parameters"]


def test_held_from_keeps_back_what_may_open_a_call():
    held_from = FORMATS["block"].held_from
    assert held_from("Hello", 0) == 5
    assert held_from("Hello <tool", 0) == len("Hello ")
    assert held_from("Hello <tool_call>{", 0) == len("Hello ")
    assert held_from("a < b", 0) == 5 and held_from("a <", 0) == 2


class Tok:
    pass


BLOCK_WEATHER = Reading(FORMATS["block"], tools([WEATHER]), False, None)  # not held, no thinking


def out(text: str, finish: str | None = None):
    from types import SimpleNamespace

    return SimpleNamespace(text=text, logprobs=[], finish_reason=finish)


def finished(text: str, finish: str = "stop"):
    from types import SimpleNamespace

    return SimpleNamespace(stream=SimpleNamespace(text=text, logprobs=[], finish_reason=finish))


def test_a_streamed_call_is_held_then_sent_as_tool_calls():
    shape = ToolChatShape(Tok(), False, BLOCK_WEATHER)
    pieces = ["Sure. <to", "ol_call>{\"name\": \"get_weather\", ", "\"arguments\": {\"city\": "
              "\"Oslo\"}}</tool_call>"]
    deltas = [shape.delta(None, out(p))["delta"] for p in pieces]
    assert deltas == [{"content": "Sure. "}, {}, {}]
    last = shape.delta(None, out("", "stop"))
    assert last["finish_reason"] == "tool_calls" and "content" not in last["delta"]
    (c,) = last["delta"]["tool_calls"]
    assert c["index"] == 0 and c["function"] == {"name": "get_weather",
                                                 "arguments": '{"city": "Oslo"}'}
    # text that only looked like a call comes out as content, whole
    shape = ToolChatShape(Tok(), False, BLOCK_WEATHER)
    sent = [shape.delta(None, out(p))["delta"].get("content", "") for p in ["a <to", "y> b"]]
    sent.append(shape.delta(None, out("", "stop"))["delta"].get("content", ""))
    assert "".join(sent) == "a <toy> b"
    whole = ToolChatShape(Tok(), False, BLOCK_WEATHER).whole(
        finished("x " + call("get_weather", city="Oslo")))
    assert whole["finish_reason"] == "tool_calls" and whole["message"]["content"] == "x"


@pytest.fixture(scope="module")
def server(tiny_spec_engine):
    from tests.server_util import start_server

    s = start_server(tiny_spec_engine, "--max-num-seqs", "2")
    yield s
    assert s.stop() == 0


def post(server, **body):
    import httpx

    body = {"model": "tiny", "max_tokens": 4, **body}
    return httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60)


def test_the_chat_endpoint_takes_tool_turns_and_names_the_bad_field(server):
    turns = [{"role": "user", "content": "a b"},
             {"role": "assistant", "content": None, "tool_calls": [
                 {"id": "c1", "type": "function",
                  "function": {"name": "get_weather", "arguments": '{"city": "x"}'}}]},
             {"role": "tool", "tool_call_id": "c1", "content": "c d"}]
    ok = post(server, messages=turns, tools=[WEATHER])  # auto: the tiny model answers text
    assert ok.status_code == 200, ok.text
    choice = ok.json()["choices"][0]
    assert choice["finish_reason"] == "length" and isinstance(choice["message"]["content"], str)
    assert post(server, messages=turns).status_code == 200  # earlier tool turns, no tools now
    bad_pattern = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "string", "pattern": "(("}}}}}
    cases = [
        (dict(messages=turns[:1], tools=[WEATHER],
              tool_choice={"type": "function", "function": {"name": "nope"}}), "tool_choice"),
        (dict(messages=[turns[0], turns[1], {"role": "tool", "content": "c"}], tools=[WEATHER]),
         "messages[2].tool_call_id"),
        (dict(messages=turns[:1], tools=[bad_pattern], tool_choice="required"), "tools"),
        (dict(messages=turns[:1], tools=[WEATHER], tool_choice="required",
              response_format={"type": "json_object"}), "tool_choice"),
        (dict(messages=turns[:1], tools=[{"type": "function"}]), "tools[0]"),
        (dict(messages=turns[:1], tools=[WEATHER], parallel_tool_calls="yes"),
         "parallel_tool_calls"),
    ]
    for body, param in cases:
        r = post(server, **body)
        assert r.status_code == 400, (body, r.text)
        assert r.json()["error"]["param"] == param, (body, r.json())
    assert post(server, messages=turns[:1]).status_code == 200  # and it still serves


def test_each_choice_holds_back_its_own_call():
    """n > 1: each choice's ToolChatShape (Shape.for_index) holds its own text; interleaved
    deltas do not mix."""
    from types import SimpleNamespace

    def out(text, finish=None):
        return SimpleNamespace(text=text, logprobs=[], finish_reason=finish)

    first = ToolChatShape(None, False, BLOCK_WEATHER)
    second = first.for_index(1)
    assert (first.index, second.index) == (0, 1)
    assert first.delta(None, out("a <to"))["delta"] == {"content": "a "}
    assert second.delta(None, out("plain"))["delta"] == {"content": "plain"}
    last = first.delta(None, out(call("get_weather", city="x")[len("<to"):], "stop"))
    assert last["index"] == 0 and last["finish_reason"] == "tool_calls"
    assert second.delta(None, out("", "stop"))["finish_reason"] == "stop"


def test_the_chat_endpoint_answers_n_choices_with_tools(server):
    r = post(server, messages=[{"role": "user", "content": "a b"}], tools=[WEATHER], n=2,
             temperature=1.0, seed=5)
    assert r.status_code == 200, r.text
    assert [c["index"] for c in r.json()["choices"]] == [0, 1]
