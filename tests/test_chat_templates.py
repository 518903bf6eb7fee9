"""Chat templates render as transformers renders them (runtime/chat_template.py): the
published templates of Llama 3.1 / 3.2 (3.3 ships 3.1's), Mistral 7B v0.3, Nemo, Small 3 and 3.1,
Qwen2.5 and Phi-3 / 3.5 / 4-mini (tests/data/chat_templates.json, each with the public copy
it was read from), over chats with a system turn, several turns, tools, calls and their
results, with and without the generation prompt: the text is byte for byte transformers'
apply_chat_template(tokenize=False), or both refuse. Also the environment's own pieces
(tojson's arguments, loop controls, strftime_now, {% generation %}) and --chat-template."""

import json
from pathlib import Path

import pytest

from tests.tiny_tokenizer import save_tiny_tokenizer
from trt_spec.runtime import chat_template
from trt_spec.runtime.tokenizer import Tokenizer

transformers = pytest.importorskip("transformers")

DATA = json.loads((Path(__file__).parent / "data/chat_templates.json").read_text())
TEMPLATES = {k: v["template"] for k, v in DATA.items() if not k.startswith("_")}
# each family's special tokens, as its tokenizer_config.json names them
SPECIALS = {"llama": {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"},
            "mistral": {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"},
            "qwen": {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"},
            "phi": {"bos_token": "<s>", "eos_token": "<|endoftext|>", "unk_token": "<unk>",
                    "pad_token": "<|endoftext|>"}}

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city.",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "description": "Its name, e.g. Zürich"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "description": "Now, <local>.",
                                         "parameters": {"type": "object", "properties": {}}}}
CALL = {"role": "assistant", "content": None, "tool_calls": [
    {"id": "a1B2c3D4e", "type": "function",
     "function": {"name": "get_weather", "arguments": {"city": "Zürich", "unit": "celsius"}}}]}
RESULT = {"role": "tool", "tool_call_id": "a1B2c3D4e", "name": "get_weather",
          "content": '{"temperature": 18, "sky": "cloudy"}'}
SYSTEM = {"role": "system", "content": "You are brief. Answer in one line."}
ASK = {"role": "user", "content": "What's the weather in Zürich? \"Quote\" & <tag>"}
CHATS = {
    "one turn": ([ASK], None),
    "system": ([SYSTEM, ASK], None),
    "several turns": ([SYSTEM, {"role": "user", "content": "Hi!"},
                       {"role": "assistant", "content": "Hello. How can I help?"}, ASK], None),
    "tools": ([SYSTEM, ASK], [WEATHER, TIME]),
    "tools, no system": ([ASK], [WEATHER]),
    "a call and its result": ([SYSTEM, ASK, CALL, RESULT], [WEATHER, TIME]),
    "a call, its result, the answer": (
        [ASK, CALL, RESULT, {"role": "assistant", "content": "18 °C and cloudy."},
         {"role": "user", "content": "Thanks."}], [WEATHER]),
}


def family(name: str) -> str:
    return next(f for f in SPECIALS if name.startswith(f))


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    """name -> (ours, transformers'): one tokenizer folder per template, with its family's
    special tokens."""
    out = {}
    for name, text in TEMPLATES.items():
        folder = tmp_path_factory.mktemp(name.replace(".", "_"))
        save_tiny_tokenizer(folder, 64)
        cfg = {**SPECIALS[family(name)], "chat_template": text,
               "tokenizer_class": "PreTrainedTokenizerFast"}
        (folder / "tokenizer_config.json").write_text(json.dumps(cfg))
        theirs = transformers.PreTrainedTokenizerFast(
            tokenizer_file=str(folder / "tokenizer.json"), **SPECIALS[family(name)])
        theirs.chat_template = text
        out[name] = (Tokenizer(folder), theirs)
    return out


def rendered(render):
    """(text, None) or (None, the error's class) of one render."""
    try:
        return render(), None
    except Exception as e:  # noqa: BLE001 - both renderers must refuse the same chats
        return None, type(e).__name__


@pytest.mark.parametrize("name", sorted(TEMPLATES))
def test_each_published_template_renders_as_transformers_renders_it(tokenizers, name):
    ours, theirs = tokenizers[name]
    rendered_some = 0
    for chat, (messages, tools) in CHATS.items():
        for prompt in (True, False):
            for extra in ({}, {"date_string": "05 Dec 2026"}):
                variables = {"tools": tools} if tools else {}
                mine, my_error = rendered(lambda: ours.apply_chat_template(
                    messages, prompt, **variables, **extra))
                want, error = rendered(lambda: theirs.apply_chat_template(
                    messages, tools=tools, add_generation_prompt=prompt, tokenize=False,
                    **extra))
                assert mine == want, (name, chat, prompt, extra, error, my_error)
                assert (my_error is None) == (error is None), (name, chat, my_error, error)
                rendered_some += mine is not None
    assert rendered_some >= 8, name  # most chats render (a refusal is not a pass)


def test_the_tool_templates_show_tools_calls_and_results(tokenizers):
    """What the parity above covers is real: each tool-taking template writes the tools, the
    call and its result into the prompt."""
    messages, tools = CHATS["a call and its result"]
    for name in ("llama-3.1", "llama-3.2", "mistral-7b-v0.3", "mistral-nemo", "mistral-small-3.1",
                 "qwen2.5"):
        text = tokenizers[name][0].apply_chat_template(messages, True, tools=tools)
        assert "get_time" in text and "Zürich" in text and "cloudy" in text, (name, text)
    llama = tokenizers["llama-3.1"][0].apply_chat_template(messages, True, tools=tools)
    assert '{\n    "type": "function",' in llama  # tojson(indent=4)
    assert "Today Date: 26 Jul 2024" in tokenizers["llama-3.1"][0].apply_chat_template(
        [ASK], True, date_string="26 Jul 2024")


ENV_CASES = [
    ("{{ x | tojson }}", {"x": {"b": "é<>&'", "a": [1, 2]}}),
    ("{{ x | tojson(indent=2) }}", {"x": {"b": 1, "a": [1, 2]}}),
    ("{{ x | tojson(separators=(',', ':'), sort_keys=true) }}", {"x": {"b": 1, "a": None}}),
    ("{{ x | tojson(ensure_ascii=true) }}", {"x": "Zürich ☃"}),
    ("{% for i in range(5) %}{% if i == 1 %}{% continue %}{% endif %}{% if i == 3 %}"
     "{% break %}{% endif %}{{ i }}{% endfor %}", {}),
    ("{{ strftime_now('%Y') }}", {}),
    ("{% generation %}{{ 'kept' }}{% endgeneration %}", {}),
    ("{% set ns = namespace(a=1) %}{% set ns.a = ns.a + 1 %}{{ ns.a }}{{ dict(b=2).b }}", {}),
    ("  {% if true %}\n  x\n  {% endif %}\n", {}),  # trim_blocks, lstrip_blocks
]


@pytest.mark.parametrize("text, variables", ENV_CASES)
def test_the_environment_is_transformers(text, variables):
    from transformers.utils.chat_template_utils import _compile_jinja_template

    ours = chat_template.compile_template(text).render(**variables)
    assert ours == _compile_jinja_template(text).render(**variables)


def test_the_sandbox_refuses_what_transformers_refuses():
    from jinja2.sandbox import SecurityError

    for text in ["{{ ''.__class__.__mro__ }}", "{% set ns = namespace(_x=1) %}",
                 "{{ messages.append(1) }}"]:
        with pytest.raises(SecurityError):
            chat_template.compile_template(text).render(messages=[])


def test_a_template_file_overrides_the_folder_s(tmp_path):
    folder = tmp_path / "tok"
    folder.mkdir()
    save_tiny_tokenizer(folder, 64)
    jinja = tmp_path / "t.jinja"
    jinja.write_text("{% for m in messages %}[{{ m.role }}] {{ m.content }}{% endfor %}")
    tok = Tokenizer(folder, template_file=jinja)
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}]) == "[user] hi"
    as_json = tmp_path / "tokenizer_config.json"  # a JSON file: its chat_template
    as_json.write_text(json.dumps({"chat_template": [
        {"name": "default", "template": "plain"}, {"name": "tool_use", "template": "tools"}]}))
    assert chat_template.read_template_file(as_json) == "plain"
    tok = Tokenizer(folder, template_file=tmp_path / "t.jinja")
    tok.named_templates = {"default": "plain", "tool_use": "tools"}
    assert tok.apply_chat_template([{"role": "user", "content": "x"}], tools=[TIME]) == "tools"
    assert tok.apply_chat_template([{"role": "user", "content": "x"}]) == "plain"


def test_a_bad_template_file_fails_quoting_the_path_and_jinja_s_line(tmp_path):
    with pytest.raises(ValueError, match=r"--chat-template .*nope\.jinja: no such file"):
        chat_template.read_template_file(tmp_path / "nope.jinja")
    bad = tmp_path / "bad.jinja"
    bad.write_text("{% for m in messages %}\n{{ m.content }\n{% endfor %}")
    with pytest.raises(ValueError, match=r"bad\.jinja does not compile: line 2: unexpected '}'"):
        chat_template.read_template_file(bad)
    for text, words in [('{"chat_template": 3}', "needs a \"chat_template\" string"),
                        ('{"chat_template": ', "does not parse")]:
        bad.write_text(text)
        with pytest.raises(ValueError, match=words):
            chat_template.read_template_file(bad)


def test_generate_serve_and_llm_take_a_template_file(tiny_engine, tmp_path):
    from click.testing import CliRunner

    from trt_spec.cli import main
    from trt_spec.runtime.api import LLM

    good = tmp_path / "plain.jinja"  # no role words: the prompt is the contents alone
    good.write_text("{% for m in messages %}{{ m.content }} {% endfor %}")
    base = ["generate", "--engine", str(tiny_engine), "--max-tokens", "2", "--json"]
    for args, prompt_tokens in [([], 8), (["--chat-template", str(good)], 3)]:
        result = CliRunner().invoke(main, base + args + ["a b c"])
        assert result.exit_code == 0, result.output
        assert json.loads(result.stdout)["metrics"]["prompt_tokens"] == prompt_tokens
    llm = LLM(tiny_engine, chat_template=str(good))
    assert llm.tokenizer.apply_chat_template([{"role": "user", "content": "x"}]) == "x "
    bad = tmp_path / "bad.jinja"
    bad.write_text("{% for m in messages %}\n{% if %}{% endif %}{% endfor %}")
    for command in [base + ["--chat-template", str(bad), "a"],
                    ["serve", "--engine", str(tiny_engine), "--chat-template", str(bad)],
                    ["serve", "--engine", str(tiny_engine), "--chat-template",
                     str(tmp_path / "missing.jinja")]]:
        result = CliRunner().invoke(main, command)
        assert result.exit_code != 0, result.output
        assert ("bad.jinja does not compile: line 2: " in result.output
                or "missing.jinja: no such file" in result.output), result.output


def test_kept_markers_stay_in_decoded_text(tmp_path):
    """A model's call markers are special tokens: decoding keeps them (where the call parser
    reads them) and still drops the other special tokens."""
    from tokenizers import Tokenizer as HFTokenizer, models, pre_tokenizers

    vocab = {"<unk>": 0, "</s>": 1, "[TOOL_CALLS]": 2, "x": 3}
    tok = HFTokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(["<unk>", "</s>", "[TOOL_CALLS]"])
    tok.save(str(tmp_path / "tokenizer.json"))
    ours = Tokenizer(tmp_path)
    assert ours.decode([2, 3, 1]) == "x"
    ours.keep_special(["[TOOL_CALLS]", "[ARGS]"])  # [ARGS]: not in this vocabulary
    assert ours.marker_ids(["[TOOL_CALLS]", "[ARGS]", "x"]) == {"[TOOL_CALLS]": 2}
    assert ours.decode([2, 3, 1]) == "[TOOL_CALLS] x"
    assert ours.decode([2, 3, 1], skip_special_tokens=False) == "[TOOL_CALLS] x </s>"
