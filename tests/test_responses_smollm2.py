"""POST /v1/responses with the official openai client against `trt-spec serve` on SmolLM2
int4 (its template has no tool section: the block format): plain and streamed text, a tool
loop (call -> function_call_output -> answer) under tool_choice required and auto, and a
JSON schema; greedy output the chat endpoint's for the same request, on every method.

Uses the exported engine in engines/smollm2-135m when there is one (else exports it)."""

import json
from pathlib import Path

import jsonschema
import openai
import pytest

from tests.server_util import start_server

pytestmark = pytest.mark.slow

ENGINE = Path(__file__).resolve().parent.parent / "engines" / "smollm2-135m"
WEATHER = {"type": "function", "name": "get_weather",
           "description": "The current weather in a city",
           "parameters": {"type": "object", "additionalProperties": False,
                          "required": ["city", "unit"],
                          "properties": {"city": {"type": "string"},
                                         "unit": {"type": "string",
                                                  "enum": ["celsius", "fahrenheit"]}}}}
CHAT_WEATHER = {"type": "function", "function": {
    k: WEATHER[k] for k in ("name", "description", "parameters")}}
PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age"],
          "properties": {"name": {"type": "string", "maxLength": 20},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120}}}
QUESTION = "What is the weather like in Lisbon today?"


@pytest.fixture(scope="module")
def client(request):
    engine = ENGINE if (ENGINE / "manifest.json").exists() else \
        request.getfixturevalue("smollm2_int4_spec_engine")
    s = start_server(engine, "--max-num-seqs", "2", model="smollm2", timeout=180)
    yield openai.OpenAI(base_url=f"{s.url}/v1", api_key="unused", max_retries=0)
    assert s.stop() == 0


@pytest.fixture(scope="module")
def methods(client):
    return client.models.list().data[0].model_extra["methods"]


def spec(method: str) -> dict:
    return {"speculative": {"method": method,
                            **({"num_draft_tokens": 4} if method != "none" else {})}}


def streamed(client, **kw):
    """(the text the deltas spell, the final response, the event types)."""
    events = list(client.responses.create(**kw, stream=True))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    return text, events[-1].response, [e.type for e in events]


def test_text_plain_and_streamed_is_the_chat_answer_on_every_method(client, methods):
    kw = dict(model="smollm2", instructions="You are a helpful assistant.",
              input="Name three colors of the rainbow.", max_output_tokens=40, temperature=0)
    seen = set()
    for method in methods:
        r = client.responses.create(**kw, extra_body=spec(method))
        chat = client.chat.completions.create(
            model="smollm2", max_completion_tokens=40, temperature=0, extra_body=spec(method),
            messages=[{"role": "system", "content": kw["instructions"]},
                      {"role": "user", "content": kw["input"]}])
        assert r.output_text == chat.choices[0].message.content, method
        assert r.usage.output_tokens == chat.usage.completion_tokens
        text, final, kinds = streamed(client, **kw, extra_body=spec(method))
        assert text == r.output_text == final.output_text, method
        assert kinds[:4] == ["response.created", "response.in_progress",
                             "response.output_item.added", "response.content_part.added"]
        assert kinds[-1] in ("response.completed", "response.incomplete")
        seen.add(r.output_text)
    assert len(seen) == 1 and len(seen.pop()) > 20  # one greedy answer, and a real one


def test_a_tool_loop_under_required_then_auto(client):
    for method in ("none", "hybrid", "auto"):
        for stream in (False, True):
            kw = dict(model="smollm2", tools=[WEATHER], parallel_tool_calls=False,
                      max_output_tokens=80, temperature=0, extra_body=spec(method))
            question = [{"role": "user", "content": QUESTION}]
            first = (streamed(client, input=question, tool_choice="required", **kw)[1]
                     if stream else
                     client.responses.create(input=question, tool_choice="required", **kw))
            (call,) = [i for i in first.output if i.type == "function_call"]
            assert call.name == "get_weather" and first.status == "completed"
            jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])
            turns = question + [
                {"type": "function_call", "call_id": call.call_id, "name": call.name,
                 "arguments": call.arguments},
                {"type": "function_call_output", "call_id": call.call_id,
                 "output": json.dumps({"temperature": 18, "sky": "cloudy"})}]
            answer = (streamed(client, input=turns, tool_choice="auto", **kw)[1] if stream
                      else client.responses.create(input=turns, tool_choice="auto", **kw))
            chat = client.chat.completions.create(
                model="smollm2", tools=[CHAT_WEATHER], tool_choice="auto",
                parallel_tool_calls=False, max_tokens=80, temperature=0,
                extra_body=spec(method), messages=question + [
                    {"role": "assistant", "content": None, "tool_calls": [
                        {"id": call.call_id, "type": "function",
                         "function": {"name": call.name, "arguments": call.arguments}}]},
                    {"role": "tool", "tool_call_id": call.call_id,
                     "content": turns[-1]["output"]}]).choices[0].message
            assert answer.output_text == (chat.content or ""), (method, stream)
            assert [(i.name, i.arguments) for i in answer.output if i.type == "function_call"] \
                == [(c.function.name, c.function.arguments) for c in chat.tool_calls or []]


def test_a_json_schema_holds_the_answer(client):
    fmt = {"type": "json_schema", "name": "person", "schema": PERSON, "strict": True}
    for method in ("none", "ngram", "auto"):
        kw = dict(model="smollm2", input="Invent a person: their name and age, as JSON.",
                  text={"format": fmt}, max_output_tokens=60, temperature=0,
                  extra_body=spec(method))
        r = client.responses.create(**kw)
        assert r.status == "completed", r.output_text
        jsonschema.validate(json.loads(r.output_text), PERSON)
        text, final, _ = streamed(client, **kw)
        assert text == r.output_text == final.output_text
        chat = client.chat.completions.create(
            model="smollm2", messages=[{"role": "user", "content": kw["input"]}],
            max_tokens=60, temperature=0, extra_body=spec(method), response_format={
                "type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}})
        assert r.output_text == chat.choices[0].message.content, method
