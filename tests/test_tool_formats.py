"""The tool-call formats of the models' own templates (runtime/tool_calls.py: llama3,
mistral, mistral-args): each chosen from the template that writes it, parsed back from the
model's text, held back while streamed, and, under tool_choice required or a named function,
held to a grammar whose output is a valid call in that format: a tiny random Llama with a
byte-level tokenizer that holds the formats' special tokens decodes under each grammar,
greedy and sampled, and every answer parses into calls whose arguments validate."""

import json
from pathlib import Path

import jsonschema
import pytest

from trt_spec.runtime import tool_calls
from trt_spec.runtime.sampling import SamplingParams
from trt_spec.runtime.tool_calls import ToolChoice, tools
from trt_spec.runtime.tool_formats import NATIVE, for_template, format_of

TEMPLATES = {k: v["template"] for k, v in json.loads(
    (Path(__file__).parent / "data/chat_templates.json").read_text()).items()
    if not k.startswith("_")}
FORMAT = {f.name + ("-spaced" if getattr(f, "space", "") else ""): f for f in NATIVE}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["city"],
                   "properties": {"city": {"type": "string", "enum": ["Oslo", "Paris"]},
                                  "rain": {"type": "boolean"}}}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {}, "additionalProperties": False}}}
GIVEN = tools([WEATHER, TIME])
SCHEMAS = {"get_weather": WEATHER["function"]["parameters"],
           "get_time": TIME["function"]["parameters"]}
MISTRAL_ARGS = ("{{ bos_token }}{% for m in messages %}{% if m.tool_calls %}{% for c in "
                "m.tool_calls %}[TOOL_CALLS]{{ c.function.name }}[ARGS]{{ c.function.arguments"
                " | tojson }}{% endfor %}{% else %}[INST]{{ m.content }}[/INST]{% endif %}"
                "{% endfor %}")


def test_each_template_gets_the_format_it_writes():
    got = {name: format_of(text).name for name, text in TEMPLATES.items()}
    assert got == {"llama-3.1": "llama3", "llama-3.2": "llama3", "mistral-7b-v0.3": "mistral",
                   "mistral-nemo": "mistral", "qwen2.5": "template",
                   "mistral-small-3": "block", "mistral-small-3.1": "mistral",
                   "phi-3-mini": "block", "phi-3.5-mini": "block",
                   # its tools are a system message's key, which the variable never reaches
                   "phi-4-mini": "block"}
    assert format_of(MISTRAL_ARGS).name == "mistral-args"
    # the list as the template spaces it
    assert format_of(TEMPLATES["mistral-7b-v0.3"]).space == " "
    assert format_of(TEMPLATES["mistral-nemo"]).space == ""


def names_and_args(calls) -> list:
    return [(c.name, json.loads(c.arguments)) for c in calls]


def test_llama3_calls_parse_with_or_without_the_python_tag():
    fmt = FORMAT["llama3"]
    for text in ['{"name": "get_weather", "parameters": {"city": "Oslo"}}',
                 '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo"}}',
                 ' {"type": "function", "name": "get_weather", "arguments": {"city": "Oslo"}}']:
        content, calls = fmt.parse(text, GIVEN)
        assert content is None and names_and_args(calls) == [("get_weather", {"city": "Oslo"})]
    two = '{"name": "get_time", "parameters": {}}; {"name": "get_weather", "parameters": {}}'
    assert [c.name for c in fmt.parse(two, GIVEN)[1]] == ["get_time", "get_weather"]
    for text in ["It is sunny.", '{"name": "nope", "parameters": {}}',
                 '{"name": "get_time", "parameters": []}', '{"name": "get_time", "param',
                 '{"name": "get_time", "parameters": {}} and then']:
        assert fmt.parse(text, GIVEN) == (text, [])  # auto: the model's text
    cut = '{"name": "get_time", "parameters": {}}; {"name": "get_weather", "para'
    assert [c.name for c in fmt.parse(cut, GIVEN, held=True)[1]] == ["get_time"]


def test_mistral_list_calls_parse_in_both_spacings():
    fmt = FORMAT["mistral"]
    for text in ['[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]',
                 '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}, '
                 '"id": "a1b2c3d4e"}]']:
        assert names_and_args(fmt.parse(text, GIVEN)[1]) == [("get_weather", {"city": "Paris"})]
    content, calls = fmt.parse('Let me see. [TOOL_CALLS][{"name": "get_time", "arguments": {}},'
                               ' {"name": "get_weather", "arguments": {"city": "Oslo"}}]', GIVEN)
    assert content == "Let me see." and [c.name for c in calls] == ["get_time", "get_weather"]
    for text in ["plain", '[TOOL_CALLS][{"name": "nope", "arguments": {}}]',
                 '[TOOL_CALLS][{"name": "get_time", "arguments": 3}]', "[TOOL_CALLS][{"]:
        assert fmt.parse(text, GIVEN) == (text, [])
    for cut in ['[TOOL_CALLS][{"name": "get_time", "arguments": {}}, {"name": "get_wea',
                '[TOOL_CALLS][{"name": "get_time", "arguments": {}}, {"name": "get_weather", '
                '"arguments": {"city": "Oslo"}']:
        assert [c.name for c in fmt.parse(cut, GIVEN, held=True)[1]] == ["get_time"]


def test_mistral_args_calls_parse_with_or_without_a_call_id():
    fmt = FORMAT["mistral-args"]
    text = ('Sure.[TOOL_CALLS]get_weather[ARGS]{"city": "Oslo", "rain": true}'
            '[TOOL_CALLS]get_time[CALL_ID]a1b2c3d4e[ARGS]{}')
    content, calls = fmt.parse(text, GIVEN)
    assert content == "Sure." and names_and_args(calls) == [
        ("get_weather", {"city": "Oslo", "rain": True}), ("get_time", {})]
    for text in ["[TOOL_CALLS]nope[ARGS]{}", "[TOOL_CALLS]get_time{}",
                 "[TOOL_CALLS]get_time[ARGS][1]", "[TOOL_CALLS]get_time[ARGS]{} more"]:
        assert fmt.parse(text, GIVEN) == (text, [])
    cut = '[TOOL_CALLS]get_time[ARGS]{}[TOOL_CALLS]get_weather[ARGS]{"ci'
    assert [c.name for c in fmt.parse(cut, GIVEN, held=True)[1]] == ["get_time"]


def test_a_stream_holds_back_what_may_become_a_call():
    llama, mistral = FORMAT["llama3"], FORMAT["mistral"]
    for text in ["", "  ", "{", '{"name"', "<|py", "<|python_tag|>{"]:
        assert llama.held_from(text, 0) == 0, text
    assert llama.held_from("Hello {", 0) == len("Hello {")  # calls are the whole answer
    assert mistral.held_from("Hi [TOOL_", 0) == 3 and mistral.held_from("Hi [TOOL_CALLS][", 0) == 3
    assert mistral.held_from("a [b]", 0) == 5


def test_mistral_turns_get_the_9_character_ids_its_templates_require():
    from trt_spec.runtime import validation
    from trt_spec.runtime.tokenizer import Tokenizer  # noqa: F401 - the renderer below

    chat = validation.chat([
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_8f2a91c0d4e6b7a3f1c2d9e0", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "call_8f2a91c0d4e6b7a3f1c2d9e0", "content": "12 C"}])
    msgs, variables = for_template(TEMPLATES["mistral-nemo"], chat, GIVEN)
    assert msgs[1]["tool_calls"][0]["id"] == msgs[2]["tool_call_id"] == "3f1c2d9e0"
    assert variables == {"tools": [t.spec() for t in GIVEN]}
    short = for_template(TEMPLATES["mistral-nemo"], [
        {"role": "tool", "tool_call_id": "c1", "content": "x"}], [])[0][0]["tool_call_id"]
    assert len(short) == 9 and short.isalnum()


# --- the grammar, on a model -------------------------------------------------------------

SPECIALS = ["</s>", "<s>", "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]", "<|python_tag|>"]


@pytest.fixture(scope="module")
def byte_engine(tmp_path_factory):
    """A tiny random Llama whose tokenizer is byte-level BPE (every byte a token, no merges)
    plus the formats' special tokens, exported to an fp32 engine folder."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    from tests.conftest import TINY_HF_CONFIG
    from trt_spec.export.config import ExportConfig
    from trt_spec.export.pipeline import export_model
    from trt_spec.runtime.tokenizer import _byte_decoder

    folder = tmp_path_factory.mktemp("byte-llama")
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(_byte_decoder())}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True) for t in SPECIALS])
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<s>", "eos_token": "</s>", "chat_template": MISTRAL_ARGS}))
    vocab = 256 + len(SPECIALS)
    torch.manual_seed(0)
    config = transformers.LlamaConfig(**{**TINY_HF_CONFIG, "vocab_size": vocab,
                                         "bos_token_id": 257, "eos_token_id": 256,
                                         "max_position_embeddings": 2048})
    transformers.LlamaForCausalLM(config).eval().save_pretrained(folder)
    return export_model(ExportConfig(str(folder), tmp_path_factory.mktemp("engines") / "b",
                                     "fp32"))


@pytest.mark.parametrize("name", sorted(FORMAT))
def test_under_tool_choice_required_the_output_is_a_valid_call(byte_engine, name):
    from trt_spec.runtime.generator import Generator
    from trt_spec.runtime.scheduler import generate_ids

    gen = Generator(byte_engine, max_batch=2)
    gen.tokenizer.keep_special(FORMAT[name].markers)
    fmt = FORMAT[name]
    prompt = gen.tokenizer.encode("[INST]weather?[/INST]", add_special_tokens=False)
    for choice, parallel in [(ToolChoice("required"), False), (ToolChoice("required"), True),
                             (ToolChoice("function", "get_weather"), False)]:
        grammar = fmt.grammar(GIVEN, choice, parallel, gen.tokenizer.marker_ids(fmt.markers))
        for seed in range(3):
            params = SamplingParams(max_tokens=120, grammar=grammar, seed=seed,
                                    temperature=0.0 if seed == 0 else 1.0)
            (s,) = generate_ids(gen, [prompt], params, "none", None)
            text = gen.tokenizer.decode(s.output_ids)
            # one call ends the answer; parallel ones may go on until max_tokens cuts them
            assert s.finish_reason == "stop" or parallel, (name, choice, text, s.guide.failure)
            content, calls = fmt.parse(text, GIVEN, held=True)
            assert calls and content is None, (name, choice, text)
            assert parallel or len(calls) == 1, text
            for c in calls:
                assert choice.mode != "function" or c.name == "get_weather"
                jsonschema.validate(json.loads(c.arguments), SCHEMAS[c.name])
            if fmt.markers:  # the format's opening is the special token itself
                assert gen.tokenizer.piece(s.output_ids[0]) in fmt.markers or name == "llama3"


@pytest.mark.parametrize("template", ["folder's", "mistral-nemo", "mistral-7b-v0.3",
                                      "mistral-small-3.1", "llama-3.1"])
def test_llm_chat_calls_tools_in_the_template_s_format(byte_engine, template, tmp_path):
    """LLM.chat end to end: the format from the template (the folder's, or --chat-template's
    published one), the tools and an earlier call rendered by it, the output held to that
    format's grammar, its markers kept in the text, and the calls parsed back."""
    from trt_spec.runtime.api import LLM

    options = {}
    if template != "folder's":
        (tmp_path / "t.jinja").write_text(TEMPLATES[template])
        options["chat_template"] = str(tmp_path / "t.jinja")
    llm = LLM(byte_engine, **options)
    chat = [{"role": "user", "content": "weather?"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "call_0123456789abcdef", "type": "function",
                 "function": {"name": "get_time", "arguments": "{}"}}]},
            {"role": "tool", "tool_call_id": "call_0123456789abcdef", "content": "09:00"},
            {"role": "assistant", "content": "It is nine."},
            {"role": "user", "content": "And the weather?"}]
    for choice in ["required", {"type": "function", "function": {"name": "get_weather"}}]:
        (out,) = llm.chat(chat, SamplingParams(max_tokens=80), tools=[WEATHER, TIME],
                          tool_choice=choice, parallel_tool_calls=False)
        (c,) = out.outputs
        assert c.tool_calls and len(c.tool_calls) == 1, (template, c.text)
        jsonschema.validate(json.loads(c.tool_calls[0].arguments),
                            SCHEMAS[c.tool_calls[0].name])
        assert isinstance(choice, str) or c.tool_calls[0].name == "get_weather"


def test_a_streamed_native_call_is_held_then_sent_as_tool_calls():
    from types import SimpleNamespace

    from trt_spec.runtime.chat import Reading
    from trt_spec.serve.chat import ToolChatShape

    def out(text, finish=None):
        return SimpleNamespace(text=text, logprobs=[], finish_reason=finish)

    cases = [(FORMAT["mistral"], ["Sure. [TOOL_", 'CALLS][{"name": "get_time", ',
                                  '"arguments": {}}]'], "Sure. "),
             (FORMAT["llama3"], ['{"name": ', '"get_time", "parameters": {}}'], ""),
             (FORMAT["mistral-args"], ["[TOOL_CALLS]get_time", "[ARGS]{}"], "")]
    for fmt, pieces, content in cases:
        shape = ToolChatShape(None, False, Reading(fmt, GIVEN, False, None))
        sent = "".join(shape.delta(None, out(p))["delta"].get("content", "") for p in pieces)
        assert sent == content, fmt.name
        last = shape.delta(None, out("", "stop"))
        assert last["finish_reason"] == "tool_calls", fmt.name
        assert [c["function"]["name"] for c in last["delta"]["tool_calls"]] == ["get_time"]
    shape = ToolChatShape(None, False, Reading(FORMAT["llama3"], GIVEN, False, None))
    assert shape.delta(None, out("It is "))["delta"] == {"content": "It is "}  # text: sent


def test_the_chat_endpoint_answers_llama_calls_streamed_and_not(byte_engine, tmp_path):
    """`serve --chat-template` with Llama 3.1's published template: tool_choice required
    answers tool_calls, whole and streamed (the held text never goes out as content)."""
    import httpx

    from tests.server_util import start_server

    (tmp_path / "llama.jinja").write_text(TEMPLATES["llama-3.1"])
    s = start_server(byte_engine, "--chat-template", str(tmp_path / "llama.jinja"))
    try:
        body = {"model": "tiny", "max_tokens": 80, "temperature": 0, "tools": [WEATHER, TIME],
                "tool_choice": "required", "parallel_tool_calls": False,
                "messages": [{"role": "user", "content": "weather?"}]}
        r = httpx.post(f"{s.url}/v1/chat/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
        (call,) = choice["message"]["tool_calls"]
        jsonschema.validate(json.loads(call["function"]["arguments"]),
                            SCHEMAS[call["function"]["name"]])
        with httpx.stream("POST", f"{s.url}/v1/chat/completions", json={**body, "stream": True},
                          timeout=60) as r:
            events = [json.loads(line[6:]) for line in r.iter_lines()
                      if line.startswith("data: {")]
        deltas = [e["choices"][0] for e in events if e["choices"]]
        assert not "".join(d["delta"].get("content") or "" for d in deltas)
        assert deltas[-1]["finish_reason"] == "tool_calls"
        assert deltas[-1]["delta"]["tool_calls"][0]["function"] == call["function"]  # greedy
    finally:
        assert s.stop() == 0
