"""POST /v1/responses with the official openai client against `trt-spec serve` on the tiny
model: text, streamed text (the event sequence), a tool loop (call -> function_call_output ->
answer) under tool_choice required and auto, a JSON schema, the errors naming the Responses
field. Greedy output is the chat endpoint's for the same request, on every method. The
translation (serve/responses_protocol.py) and the items and events (responses_stream.py) are
checked on their own first."""

import json

import httpx
import jsonschema
import openai
import pytest

from tests.server_util import start_server
from trt_spec.serve.protocol import RequestError
from trt_spec.serve.responses_protocol import ResponsesRequest, chat_request
from trt_spec.serve.responses_stream import Builder

WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city",
           "parameters": {"type": "object", "required": ["city"], "additionalProperties": False,
                          "properties": {"city": {"type": "string", "maxLength": 6}}}}
CHAT_WEATHER = {"type": "function", "function": {
    k: WEATHER[k] for k in ("name", "description", "parameters")}}
SCHEMA = {"type": "object", "required": ["name", "age"], "additionalProperties": False,
          "properties": {"name": {"type": "string", "maxLength": 8},
                         "age": {"type": "integer", "minimum": 0, "maximum": 99}}}


def translated(**body):
    chat, names = chat_request(ResponsesRequest.model_validate({"model": "tiny", **body}))
    return chat, names


def test_input_items_become_chat_turns():
    chat, names = translated(instructions="be brief", input=[
        {"role": "user", "content": [{"type": "input_text", "text": "a "},
                                     {"type": "input_text", "text": "b"}]},
        {"type": "reasoning", "id": "rs_1", "summary": []},  # sent back: dropped
        {"type": "message", "role": "assistant", "content": [
            {"type": "output_text", "text": "c", "annotations": []}]},
        {"type": "function_call", "call_id": "c1", "name": "get_weather",
         "arguments": '{"city": "x"}'},
        {"type": "function_call", "call_id": "c2", "name": "get_weather",
         "arguments": '{"city": "y"}'},
        {"type": "function_call_output", "call_id": "c1", "output": "d"},
        {"type": "function_call_output", "call_id": "c2",
         "output": [{"type": "input_text", "text": "e"}]}],
        tools=[WEATHER], tool_choice={"type": "function", "name": "get_weather"},
        text={"format": {"type": "json_schema", "name": "p", "schema": SCHEMA}},
        max_output_tokens=7, reasoning={"effort": "none"}, top_logprobs=2)
    calls = [{"id": c, "type": "function", "function": {"name": "get_weather",
                                                        "arguments": f'{{"city": "{x}"}}'}}
             for c, x in (("c1", "x"), ("c2", "y"))]
    assert chat.messages == [
        {"role": "system", "content": "be brief"}, {"role": "user", "content": "a b"},
        {"role": "assistant", "content": "c", "tool_calls": calls},  # one turn
        {"role": "tool", "tool_call_id": "c1", "content": "d"},
        {"role": "tool", "tool_call_id": "c2", "content": "e"}]
    assert chat.tools == [CHAT_WEATHER]
    assert chat.tool_choice == {"type": "function", "function": {"name": "get_weather"}}
    assert chat.response_format == {"type": "json_schema",
                                    "json_schema": {"name": "p", "schema": SCHEMA}}
    assert (chat.max_completion_tokens, chat.logprobs, chat.top_logprobs) == (7, True, 2)
    assert chat.chat_template_kwargs == {"enable_thinking": False}
    # the chat path's field paths, named back as the client wrote them
    assert names.path("messages[0].content") == "instructions"
    assert names.path("messages[2].tool_calls[1].function.arguments") == "input[4].arguments"
    assert names.path("messages[4].content") == "input[6].output"
    assert names.path("tools[0].function.parameters") == "tools[0].parameters"
    e = names.error(RequestError("response_format: bad; max_tokens=0", "response_format"))
    assert (e.param, e.message) == ("text.format", "text.format: bad; max_output_tokens=0")


@pytest.mark.parametrize("body, param, words", [
    (dict(input="a", previous_response_id="resp_1"), "previous_response_id", "keeps no"),
    (dict(input="a", conversation="conv_1"), "conversation", "keeps no"),
    (dict(input="a", background=True), "background", "background"),
    (dict(input=[{"type": "item_reference", "id": "msg_1"}]), "input[0].type", "keeps none"),
    (dict(input=[{"type": "web_search_call"}]), "input[0].type", "function_call_output"),
    (dict(input=[{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]),
     "input[0].content[0]", "only text parts"),
    (dict(input=[{"role": "tool", "content": "a"}]), "input[0].role", "developer"),
    (dict(input=[{"type": "function_call_output", "output": "a"}]), "input[0].call_id",
     "string"),
    (dict(input=[]), "input", "non-empty"),
    (dict(input="a", tools=[{"type": "web_search"}]), "tools[0]", "only function tools"),
    (dict(input="a", text={"format": {"type": "json_schema", "name": "x"}}),
     "text.format.schema", "needs its schema"),
    (dict(input="a", text={"format": {"type": "yaml"}}), "text.format", "json_schema"),
    (dict(input="a", reasoning={"effort": "lots"}), "reasoning", "minimal"),
    (dict(input="a", truncation="auto"), "truncation", "disabled"),
    (dict(input="a", max_tool_calls=2), "max_tool_calls", "parallel_tool_calls"),
])
def test_what_is_not_served_is_a_400_naming_the_field(body, param, words):
    with pytest.raises(RequestError) as e:
        translated(**body)
    assert (e.value.status, e.value.param) == (400, param) and words in e.value.message


def test_a_conversation_s_turns_share_one_replica_key():
    """Under Ray Serve every turn of a Responses conversation goes where the first one left
    its KV rows (serve/affinity.py): the key is the tools, instructions and input up to the
    first user message."""
    from trt_spec.serve.affinity import route_key

    def key(**body):
        return route_key("/v1/responses", json.dumps({"model": "tiny", **body}).encode())

    first = [{"role": "user", "content": "a b"}]
    later = first + [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"},
                     {"type": "function_call_output", "call_id": "c", "output": "x"}]
    assert key(input=first, tools=[WEATHER]) == key(input=later, tools=[WEATHER]) is not None
    assert key(input=first) != key(input=first, instructions="i") != key(input="a b")
    assert key(input="a b") is not None and key(input=[]) is None


def types(events) -> list[str]:
    return [e["type"] for e in events]


def test_items_and_events_in_the_order_the_responses_api_sends_them():
    b = Builder({"id": "resp_1"})
    events = b.opening()
    events += b.feed({"reasoning_content": "hm"}, [])
    events += b.feed({"reasoning_content": "m", "content": "a"}, [])
    events += b.feed({"content": "b"}, [{"token": "b", "logprob": -1.0}])
    events += b.feed({"content": "", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}, [])
    response, end = b.finish("stop", {"output_tokens": 3}, {"seed": 1})
    events += end
    assert types(events) == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.content_part.added",
        "response.reasoning_text.delta", "response.reasoning_text.delta",
        "response.reasoning_text.done", "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.delta",
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done",
        "response.completed"]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    reasoning, message, call = response["output"]
    assert reasoning["content"] == [{"type": "reasoning_text", "text": "hmm"}]
    assert message["content"][0]["text"] == "ab" and message["status"] == "completed"
    assert message["content"][0]["logprobs"] == [{"token": "b", "logprob": -1.0}]
    assert (call["call_id"], call["name"], call["arguments"]) == ("c1", "f", "{}")
    assert events[2]["item"]["status"] == "in_progress"  # a snapshot, not the later item
    assert response["status"] == "completed" and response["seed"] == 1
    cut, end = Builder({}).finish("length", {}, {})  # nothing written, cut short
    assert cut["status"] == "incomplete" and cut["output"][0]["status"] == "incomplete"
    assert cut["incomplete_details"] == {"reason": "max_output_tokens"}
    b = Builder({})
    b.feed({"content": "a"}, [])
    failed = b.failed({"message": "gone", "code": "abort", "param": None})
    assert types(failed) == ["response.output_text.done", "response.content_part.done",
                             "response.output_item.done", "response.failed"]
    assert failed[-1]["response"]["status"] == "failed"
    assert failed[-1]["response"]["error"] == {"code": "abort", "message": "gone"}


TEMPLATE = ("{% for m in messages %}<s>{{ m['role'] }}\n{{ m['content'] }}</s>{% endfor %}"
            "{% if add_generation_prompt %}<s>assistant\n{% endif %}")


@pytest.fixture(scope="module")
def byte_engine(tmp_path_factory):
    """A tiny random Llama with a byte-level tokenizer (every byte a token: tool calls and
    JSON can be spelled) and a chat template without a tool section (the block format), plus
    a noisy copy of it as a vanilla draft, exported fp32."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    from tests.conftest import TINY_HF_CONFIG
    from trt_spec.export.config import ExportConfig
    from trt_spec.export.pipeline import export_model
    from trt_spec.runtime.tokenizer import _byte_decoder

    target, draft = tmp_path_factory.mktemp("byte-target"), tmp_path_factory.mktemp("byte-draft")
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(_byte_decoder())}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True) for t in ("</s>", "<s>")])
    torch.manual_seed(0)
    config = transformers.LlamaConfig(**{**TINY_HF_CONFIG, "vocab_size": 258,
                                         "bos_token_id": 257, "eos_token_id": 256,
                                         "max_position_embeddings": 1024})
    model = transformers.LlamaForCausalLM(config).eval()
    for folder, noise in ((target, 0.0), (draft, 0.02)):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p) * noise)
        model.save_pretrained(folder)
        tok.save(str(folder / "tokenizer.json"))
        (folder / "tokenizer_config.json").write_text(json.dumps({
            "bos_token": "<s>", "eos_token": "</s>", "chat_template": TEMPLATE}))
    return export_model(ExportConfig(str(target), tmp_path_factory.mktemp("engines") / "b",
                                     "fp32", drafters={"vanilla": str(draft)}))


@pytest.fixture(scope="module")
def server(byte_engine):
    s = start_server(byte_engine, "--max-num-seqs", "2")
    yield s
    assert s.stop() == 0


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def methods(client):
    return [m for m in client.models.list().data[0].model_extra["methods"]]


def spec(method: str) -> dict:
    return {"speculative": {"method": method, **({"num_draft_tokens": 3}
                                                 if method != "none" else {})}}


def test_text_is_the_chat_answer_on_every_method(client, methods):
    assert "none" in methods and len(methods) > 1
    for method in methods:
        r = client.responses.create(model="tiny", input="a b c", instructions="d e",
                                    max_output_tokens=12, temperature=0,
                                    extra_body=spec(method))
        chat = client.chat.completions.create(
            model="tiny", messages=[{"role": "system", "content": "d e"},
                                    {"role": "user", "content": "a b c"}],
            max_completion_tokens=12, temperature=0, extra_body=spec(method))
        assert r.output_text == chat.choices[0].message.content, method
        assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
        assert r.usage.input_tokens == chat.usage.prompt_tokens
        assert r.usage.output_tokens == chat.usage.completion_tokens == 12
        assert r.usage.input_tokens_details.cached_tokens >= 0
        assert r.model_extra["metrics"]["method"] == method
        assert r.id.startswith("resp_") and r.object == "response" and r.store is False


def test_streamed_text_comes_as_the_responses_events(client):
    kw = dict(model="tiny", input=[{"role": "user", "content": "a b c"}], instructions="d e",
              max_output_tokens=10,
              temperature=0, extra_body={"token_sources": True})
    whole = client.responses.create(**kw)
    events = list(client.responses.create(**kw, stream=True))
    kinds = types([e.model_dump() for e in events])
    deltas = kinds.count("response.output_text.delta")
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.content_part.added", *["response.output_text.delta"] * deltas,
                     "response.output_text.done", "response.content_part.done",
                     "response.output_item.done", "response.incomplete"] and deltas > 1
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text == events[-1].response.output_text
    assert events[-1].response.usage.output_tokens == 10
    sources = events[-1].response.model_extra["token_sources"]
    assert len(sources) == 10 and "".join(s["text"] for s in sources) == text


def tool_turn(client, input, choice, stream=False):
    kw = dict(model="tiny", input=input, tools=[WEATHER], tool_choice=choice,
              parallel_tool_calls=False, max_output_tokens=100, temperature=0)
    if not stream:
        return client.responses.create(**kw)
    events = list(client.responses.create(**kw, stream=True))
    args = [e for e in events if e.type == "response.function_call_arguments.done"]
    final = events[-1].response
    assert [a.arguments for a in args] == [i.arguments for i in final.output
                                           if i.type == "function_call"]
    return final


@pytest.mark.parametrize("stream", [False, True])
def test_a_tool_loop_under_required_then_auto(client, stream):
    question = [{"role": "user", "content": "a b"}]
    first = tool_turn(client, question, "required", stream)
    (call,) = [i for i in first.output if i.type == "function_call"]
    assert call.name == "get_weather" and call.call_id and first.status == "completed"
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])
    chat = client.chat.completions.create(model="tiny", messages=question,
                                          tools=[CHAT_WEATHER], tool_choice="required",
                                          parallel_tool_calls=False, max_tokens=100,
                                          temperature=0).choices[0].message
    assert [(c.function.name, c.function.arguments) for c in chat.tool_calls] == \
        [(call.name, call.arguments)]
    # the call and its output sent back as items, as agent loops do
    turns = question + [{"type": "function_call", "call_id": call.call_id, "name": call.name,
                         "arguments": call.arguments},
                        {"type": "function_call_output", "call_id": call.call_id,
                         "output": "c d"}]
    answer = tool_turn(client, turns, "auto", stream)
    chat = client.chat.completions.create(
        model="tiny", tools=[CHAT_WEATHER], tool_choice="auto", parallel_tool_calls=False,
        max_tokens=100, temperature=0, messages=question + [
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": call.call_id, "type": "function",
                 "function": {"name": call.name, "arguments": call.arguments}}]},
            {"role": "tool", "tool_call_id": call.call_id, "content": "c d"}]).choices[0]
    assert answer.output_text == (chat.message.content or "")
    assert [i.arguments for i in answer.output if i.type == "function_call"] == \
        [c.function.arguments for c in chat.message.tool_calls or []]


def test_a_json_schema_holds_the_output(client, methods):
    fmt = {"type": "json_schema", "name": "person", "schema": SCHEMA, "strict": True}
    for method in methods:
        r = client.responses.create(model="tiny", input="a b", text={"format": fmt},
                                    max_output_tokens=60, temperature=0,
                                    extra_body=spec(method))
        assert r.status == "completed", r.output_text
        jsonschema.validate(json.loads(r.output_text), SCHEMA)
        chat = client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "a b"}], max_tokens=60,
            temperature=0, extra_body=spec(method), response_format={
                "type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}})
        assert r.output_text == chat.choices[0].message.content, method
        assert r.text.format.type == "json_schema"


def test_logprobs_and_the_seed_come_back(client):
    r = client.responses.create(model="tiny", input="a", max_output_tokens=4, top_logprobs=2,
                                include=["message.output_text.logprobs"], temperature=1.0,
                                extra_body={"seed": 9})
    (part,) = r.output[0].content
    assert len(part.logprobs) == 4 and all(len(lp.top_logprobs) == 2 for lp in part.logprobs)
    again = client.responses.create(model="tiny", input="a", max_output_tokens=4,
                                    temperature=1.0, extra_body={"seed": 9})
    assert again.output_text == r.output_text and again.model_extra["seed"] == 9


def post(server, **body):
    return httpx.post(f"{server.url}/v1/responses", json={"model": "tiny", **body},
                      timeout=60)


@pytest.mark.parametrize("body, param, words", [
    (dict(input="a", previous_response_id="resp_1"), "previous_response_id", "keeps no"),
    (dict(input="a", max_output_tokens=0), "max_output_tokens", "max_output_tokens=0"),
    (dict(input="a", temperature=-1), "temperature", "-1"),
    (dict(input="a", tools=[{**WEATHER, "name": "no spaces"}]), "tools[0].name", "letters"),
    (dict(input="a", tools=[WEATHER], tool_choice={"type": "function", "name": "nope"}),
     "tool_choice", "nope"),
    (dict(input="a", tools=[WEATHER], tool_choice="required",
          text={"format": {"type": "json_object"}}), "tool_choice", "text.format"),
    (dict(input=[{"type": "function_call", "call_id": "c", "name": "f",
                  "arguments": "{not json"}]), "input[0].arguments", "input[0].arguments"),
    (dict(input="a", speculative={"method": "nope"}), "speculative", "nope"),
    (dict(input="a", frequency=1), "frequency", "unknown field"),
    (dict(model="other", input="a"), "model", "other"),
])
def test_errors_name_the_responses_field(server, body, param, words):
    r = post(server, **body)
    assert r.status_code in (400, 404), r.text
    error = r.json()["error"]
    assert error["param"] == param and words in error["message"], error
    assert error["type"] == "invalid_request_error"
    assert "messages" not in error["message"] and "response_format" not in error["message"]


THINKING = ("{% for m in messages %}<s>{{ m['role'] }}\n{{ m['content'] }}</s>{% endfor %}"
            "{% if add_generation_prompt %}<s>assistant\n{% if enable_thinking is defined and "
            "enable_thinking is false %}<think></think>{% else %}<think>{% endif %}{% endif %}")


def test_the_thinking_comes_as_a_reasoning_item(byte_engine, tmp_path):
    """A template that opens the think block in the prompt: the answer starts thinking, and
    its thinking is the output's reasoning item (chat's reasoning_content); effort "none"
    turns it off (chat's enable_thinking: false)."""
    (tmp_path / "think.jinja").write_text(THINKING)
    s = start_server(byte_engine, "--chat-template", str(tmp_path / "think.jinja"))
    try:
        client = openai.OpenAI(base_url=f"{s.url}/v1", api_key="unused", max_retries=0)
        kw = dict(model="tiny", input="a b", max_output_tokens=8, temperature=0)
        r = client.responses.create(**kw)
        chat = client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "a b"}], max_tokens=8,
            temperature=0).choices[0].message
        # the random model never closes the think block: cut while thinking, all reasoning
        (reasoning,) = r.output
        assert reasoning.type == "reasoning" and reasoning.summary == []
        assert reasoning.content[0].text == chat.model_extra["reasoning_content"] != ""
        assert r.output_text == chat.content == "" and reasoning.status == "incomplete"
        assert 0 < r.usage.output_tokens_details.reasoning_tokens <= 8
        kinds = [e.type for e in client.responses.create(**kw, stream=True)]
        assert kinds[2:5] == ["response.output_item.added", "response.content_part.added",
                              "response.reasoning_text.delta"]
        assert "response.reasoning_text.done" in kinds
        off = client.responses.create(**kw, reasoning={"effort": "none"})
        assert [i.type for i in off.output] == ["message"]
        assert off.output_text == client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "a b"}], max_tokens=8,
            temperature=0, extra_body={"chat_template_kwargs": {"enable_thinking": False}}
        ).choices[0].message.content
    finally:
        assert s.stop() == 0
