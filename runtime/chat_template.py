"""Chat templates rendered as transformers renders them, without transformers.

A model's template is Jinja written against transformers' renderer
(transformers/utils/chat_template_utils.py, 5.x), so it is rendered here in the same
environment, with the same names in it, to give the same text as
`tokenizer.apply_chat_template(messages, tools=..., tokenize=False)`:

    environment  jinja2's ImmutableSandboxedEnvironment (the template is untrusted code),
                 trim_blocks and lstrip_blocks, loop controls ({% break %}, {% continue %})
                 and {% generation %} ... {% endgeneration %} (its body rendered as it is:
                 the assistant-token mask it marks is training's business)
    globals      raise_exception(message); strftime_now(format): the local time now, as
                 datetime.now().strftime (Llama 3.x's "Today Date", Mistral Small's date);
                 dict(...) and namespace(...) (a namespace refuses names that start with _)
    filters      tojson(x, ensure_ascii=False, indent=None, separators=None,
                 sort_keys=False): json.dumps with those arguments (jinja's own tojson
                 escapes < > & ' for HTML, which no prompt wants)
    variables    messages (keys whose value is None dropped; a message's reasoning under
                 reasoning_content and thinking too), tools and documents (None where not
                 given), add_generation_prompt, the tokenizer's named special tokens that
                 are set (bos_token, eos_token, unk_token, pad_token), then the caller's
                 variables, which override them

A template file (`--chat-template FILE`) holds the template's text, or a JSON object whose
`chat_template` is it (a tokenizer_config.json or chat_template.json); one that cannot be
read or does not compile is a ValueError quoting the path and jinja's message with its line.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

from jinja2 import TemplateError, TemplateSyntaxError, nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment, SecurityError
from jinja2.utils import Namespace

# a message's reasoning, by the names templates read it under (transformers' list)
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


class Generation(Extension):
    """{% generation %} ... {% endgeneration %}: the body, rendered as it is."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller):
        return caller()


class Refused(TemplateError):
    """The template's raise_exception: it refuses the request, saying why."""


def raise_exception(message):
    raise Refused(message)


def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def strftime_now(format):  # noqa: A002 - the name templates call it with
    return datetime.now().strftime(format)


class TemplateDict:
    """dict(...) and dict.fromkeys(...), and nothing else of the type."""

    def __call__(self, *args, **kwargs):
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
        return dict.fromkeys(*args, **kwargs)


class TemplateNamespace(Namespace):
    """jinja's namespace(), refusing attributes that start with _ (CPython's internals)."""

    def __init__(*args, **kwargs):  # noqa: N805 - Namespace's own signature trick
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            TemplateNamespace._check_name(name)
        Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        TemplateNamespace._check_name(name)
        Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name):
        if isinstance(name, str) and name.startswith("_"):
            raise SecurityError(f"a chat template cannot set {name!r} on a namespace (names "
                                "that start with _ are refused)")


def environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[Generation, loopcontrols])
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, strftime_now=strftime_now,
                       dict=TemplateDict(), namespace=TemplateNamespace)
    return env


def compile_template(text: str, where: str = "the chat template"):
    """The compiled template; ValueError naming `where`, the line and jinja's message where
    it does not compile."""
    if not isinstance(text, str):
        raise ValueError(f"{where}: expected the template's text, got {type(text).__name__}")
    try:
        return environment().from_string(text)
    except TemplateSyntaxError as e:
        raise ValueError(f"{where} does not compile: line {e.lineno}: {e.message}") from None


def plain_messages(messages: list[dict]) -> list[dict]:
    """As transformers hands messages to a template: keys whose value is None dropped (a call
    turn's content=None), a message's reasoning under every name templates read it by."""
    out = []
    for m in messages:
        m = {k: v for k, v in m.items() if v is not None}
        reasoning = next((m[k] for k in REASONING_FIELDS if m.get(k) is not None), None)
        if reasoning is not None:
            m = {"thinking": reasoning, **m, "reasoning_content": reasoning}
        out.append(m)
    return out


def render(template, messages: list[dict], add_generation_prompt: bool,
           special_tokens: dict[str, str], variables: dict) -> str:
    """The template's text for `messages`; special_tokens: the tokenizer's named ones that
    are set; variables: the template's others (tools, enable_thinking, ...)."""
    given = {"tools": None, "documents": None, **special_tokens, **variables}
    return template.render(messages=plain_messages(messages),
                           add_generation_prompt=add_generation_prompt, **given)


def open_final_message(text: str, messages: list[dict]) -> str:
    """The rendered chat cut right after the last message's content, so the model goes on
    with that message (transformers' continue_final_message): the template's end-of-turn
    after it dropped. ValueError where the text does not show that content."""
    content = messages[-1].get("content")
    if not isinstance(content, str) or not content.strip():
        raise ValueError("continue_final_message: the last message has no text to continue")
    at = text.rfind(content.strip())
    if at < 0:
        raise ValueError("continue_final_message: the chat template does not show the last "
                         "message's content as it is, so it cannot be left open")
    # the content as given, where the template kept its trailing whitespace; else stripped
    whole = content.lstrip()
    keep = len(whole) if text[at:at + len(whole)] == whole else len(content.strip())
    return text[:at + keep]


def read_template_file(path: str | Path) -> str:
    """The template a --chat-template file holds: its text, or the `chat_template` of a JSON
    object (a tokenizer_config.json); compiled here, so a bad one fails at start."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ValueError(f"--chat-template {path}: no such file") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"--chat-template {path}: cannot be read ({e})") from None
    if text.lstrip().startswith("{") and not text.lstrip().startswith(("{{", "{%", "{#")):
        try:
            data = json.loads(text)
        except ValueError as e:
            raise ValueError(f"--chat-template {path}: looks like JSON but does not parse "
                             f"({e})") from None
        text = data.get("chat_template") if isinstance(data, dict) else None
        text = named_template(text, None) if isinstance(text, list) else text
        if not isinstance(text, str):
            raise ValueError(f"--chat-template {path}: a JSON file needs a \"chat_template\" "
                             "string (or a list of {\"name\", \"template\"})")
    compile_template(text, f"--chat-template {path}")
    return text


def named_template(templates, tools) -> str | None:
    """Of a tokenizer's named templates ([{"name", "template"}], or a dict name -> text) the
    one transformers picks: "tool_use" where tools are given and it has one, else
    "default"; None where it has neither."""
    if isinstance(templates, list):
        templates = {t.get("name"): t.get("template") for t in templates if isinstance(t, dict)}
    if tools and "tool_use" in templates:
        return templates["tool_use"]
    return templates.get("default")
