"""A tool loop as agent frameworks run it, with the official openai client against `trt-spec
serve` on SmolLM2 int4 (its template has no tool section: the block format): call -> tool
result -> final answer, under tool_choice required, a named function and auto, streamed and
not, on none, ngram, hybrid and auto. Every call's arguments validate against the function's
schema, and greedy output is the same on every method."""

import json

import jsonschema
import openai
import pytest

from tests.server_util import start_server

pytestmark = pytest.mark.slow

TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "The current weather in a city",
        "parameters": {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
                       "properties": {"city": {"type": "string"},
                                      "unit": {"type": "string",
                                               "enum": ["celsius", "fahrenheit"]}}}}},
    {"type": "function", "function": {
        "name": "convert_currency", "description": "Convert an amount between currencies",
        "parameters": {"type": "object", "additionalProperties": False,
                       "required": ["amount", "from", "to"],
                       "properties": {"amount": {"type": "number"},
                                      "from": {"type": "string", "pattern": "^[A-Z]{3}$"},
                                      "to": {"type": "string", "pattern": "^[A-Z]{3}$"}}}}},
]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
RESULTS = {"get_weather": {"temperature": 18, "sky": "cloudy"},
           "convert_currency": {"result": 91.3}}
QUESTIONS = ["What is the weather like in Lisbon today?",
             "How much is 100 US dollars in euros?"]
CHOICES = {"required": "required",
           "named": {"type": "function", "function": {"name": "convert_currency"}},
           "auto": "auto"}
METHODS = ["none", "ngram", "hybrid", "auto"]


@pytest.fixture(scope="module")
def client(smollm2_int4_spec_engine):
    s = start_server(smollm2_int4_spec_engine, "--max-num-seqs", "2", model="smollm2",
                     timeout=180)
    yield openai.OpenAI(base_url=f"{s.url}/v1", api_key="unused", max_retries=0)
    assert s.stop() == 0


def ask(client, messages, choice, method: str, stream: bool) -> dict:
    """One turn -> {"content", "calls": [(id, name, arguments)], "finish"}; a stream is
    assembled as the openai client's users do."""
    kw = dict(model="smollm2", messages=messages, tools=TOOLS, tool_choice=choice,
              parallel_tool_calls=False, temperature=0, max_tokens=96,
              extra_body={"speculative": {"method": method,
                                          **({"num_draft_tokens": 4} if method != "none"
                                             else {})}})
    if not stream:
        m = client.chat.completions.create(**kw).choices[0]
        calls = [(c.id, c.function.name, c.function.arguments)
                 for c in m.message.tool_calls or []]
        return {"content": m.message.content, "calls": calls, "finish": m.finish_reason}
    content, calls, finish = "", {}, None
    for chunk in client.chat.completions.create(**kw, stream=True):
        if not chunk.choices:
            continue
        d = chunk.choices[0].delta
        content += d.content or ""
        for c in d.tool_calls or []:
            got = calls.setdefault(c.index, [c.id, "", ""])
            got[1] += c.function.name or ""
            got[2] += c.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    return {"content": content or None, "calls": [tuple(c) for c in calls.values()],
            "finish": finish}


def loop(client, question: str, choice, method: str, stream: bool) -> list[dict]:
    """The agent's loop: ask; run each call; hand the results back; the final answer."""
    messages = [{"role": "user", "content": question}]
    first = ask(client, messages, choice, method, stream)
    turns = [first]
    if first["calls"]:
        messages.append({"role": "assistant", "content": first["content"], "tool_calls": [
            {"id": i, "type": "function", "function": {"name": n, "arguments": a}}
            for i, n, a in first["calls"]]})
        messages += [{"role": "tool", "tool_call_id": i, "content": json.dumps(RESULTS[n])}
                     for i, n, _ in first["calls"]]
        turns.append(ask(client, messages, "none", method, stream))
    return turns


@pytest.mark.parametrize("choice", list(CHOICES))
def test_a_tool_loop_validates_and_is_the_same_on_every_method(client, choice):
    seen = {}
    for method in METHODS:
        for stream in (False, True):
            for q in QUESTIONS:
                turns = loop(client, q, CHOICES[choice], method, stream)
                first = turns[0]
                if choice != "auto":
                    assert first["finish"] == "tool_calls" and len(first["calls"]) == 1, first
                    assert len(turns) == 2 and turns[1]["finish"] in ("stop", "length")
                if choice == "named":
                    assert first["calls"][0][1] == "convert_currency"
                for _, name, arguments in first["calls"]:
                    jsonschema.validate(json.loads(arguments), SCHEMAS[name])
                # ids differ per call: compare what the model wrote
                written = [{k: v for k, v in t.items() if k != "calls"}
                           | {"calls": [c[1:] for c in t["calls"]]} for t in turns]
                key = (q, stream)
                seen.setdefault(key, written)
                assert written == seen[key], (choice, method, stream, q)
    # streamed and not agree too
    for q in QUESTIONS:
        assert seen[(q, True)] == seen[(q, False)], q
