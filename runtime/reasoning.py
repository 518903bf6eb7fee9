"""Reasoning models: the thinking section of an answer, told apart from the answer itself.

A chat template with a thinking section (Qwen3: it writes `<think>` and reads
`enable_thinking`) lets the model think first, between <think> and </think>, then answer.
Which format applies is read from the template, never from the model's name:

    thinking   the template mentions <think>: the answer's text splits at </think> into
               (reasoning, content), vLLM's `reasoning_content` and `content`
    none       any other template: the whole text is content, as before

With `enable_thinking: false` Qwen3's template closes an empty think block in the prompt
itself, so the output holds no </think> and is all content. A template that opens the block
in the prompt (the output starts inside it) is read from the prompt's tail (`opened`).

Under a structure (a JSON schema, a regex, a grammar, choices, tool calls) the output is held
to it only after the thinking section: `after_thinking` nests the structure's grammar behind a
think block that lets the model think freely first.
"""

from __future__ import annotations

import dataclasses
import json

from trt_spec.runtime.validation import FieldError, _show

OPEN, CLOSE = "<think>", "</think>"
# the template's own variables: chat_template_kwargs may not set them; nor the renderer's
# own argument (self) or the names the template calls (runtime/chat_template.py's
# environment: jinja's globals, raise_exception, strftime_now), which a variable would shadow
RESERVED = ("messages", "tools", "documents", "add_generation_prompt", "bos_token",
            "eos_token", "unk_token", "pad_token", "self", "raise_exception", "strftime_now",
            "range", "dict", "lipsum", "cycler", "joiner", "namespace")
MAX_KWARGS = 32


def has_thinking(chat_template: str | None) -> bool:
    """The template has a thinking section (it writes <think>)."""
    return bool(chat_template) and OPEN in chat_template


def opened(prompt_tail: str) -> bool:
    """The prompt ends inside an open think block (the output starts in the reasoning)."""
    return prompt_tail.rfind(OPEN) > prompt_tail.rfind(CLOSE)


def template_kwargs(value, field: str = "chat_template_kwargs") -> dict:
    """chat_template_kwargs, checked: a dict of string keys, none of the template's own."""
    if value is None:
        return {}
    if not isinstance(value, dict) or len(value) > MAX_KWARGS \
            or not all(isinstance(k, str) and k.isidentifier() for k in value):
        raise FieldError(field, f"{field}={_show(value)}: expected an object of at most "
                                f"{MAX_KWARGS} variables (identifier keys), e.g. "
                                '{"enable_thinking": false}')
    taken = [k for k in value if k in RESERVED]
    if taken:
        raise FieldError(field, f"{field} sets {', '.join(taken)}, which the server sets "
                                f"itself ({', '.join(RESERVED)} are the template's and its "
                                "renderer's own)")
    return dict(value)


def thinks(chat_template: str | None, variables: dict) -> bool:
    """The model thinks before it answers: the template has a thinking section and the
    request does not turn it off (enable_thinking: false)."""
    return has_thinking(chat_template) and variables.get("enable_thinking", True) is not False


def thinking_of(tokenizer, variables: dict, prompt_ids: list[int]) -> bool | None:
    """How a chat's answer starts: None where it does not think (`thinks`); else whether its
    prompt opened the think block (the template wrote <think> and left it open)."""
    if not thinks(tokenizer.chat_template, variables):
        return None
    return opened(tokenizer.decode(prompt_ids[-16:], skip_special_tokens=False))


def parts(text: str, opened_: bool = False, final: bool = True) -> tuple[str | None, str]:
    """(reasoning, content) of an answer's text: the reasoning runs from a leading <think>
    (or from the start, `opened_`) to </think>; None where the answer does not think. Not
    `final` (streaming): what may yet become a tag is left out of both."""
    body = text
    if not opened_:
        head = text.lstrip()
        if head.startswith(OPEN):
            body = head[len(OPEN):]
        elif not final and OPEN.startswith(head):
            return "", ""  # (the answer may yet open a think block)
        else:
            return None, text
    at = body.find(CLOSE)
    if at >= 0:
        return body[:at], body[at + len(CLOSE):].lstrip()
    if final:
        return body, ""  # cut short while thinking
    return body[:len(body) - held_tail(body)], ""


def split(text: str, opened_: bool = False) -> tuple[str | None, str]:
    """A finished answer's (reasoning, content): reasoning None where it did not think."""
    return parts(text, opened_, final=True)


def held_tail(text: str) -> int:
    """How many characters at the end of `text` may yet become </think>."""
    for n in range(min(len(CLOSE) - 1, len(text)), 0, -1):
        if CLOSE.startswith(text[len(text) - n:]):
            return n
    return 0


class Splitter:
    """A streamed answer's reasoning and content, piece by piece: each `feed` gives the new
    reasoning and the new content, holding back a tail that may yet become a tag."""

    def __init__(self, opened_: bool = False):
        self.opened = opened_
        self.text = ""
        self.sent = (0, 0)  # reasoning, content characters handed out

    def feed(self, text: str, final: bool = False) -> tuple[str, str]:
        self.text += text
        reasoning, content = parts(self.text, self.opened, final)
        reasoning = reasoning or ""
        r, c = self.sent
        self.sent = (max(r, len(reasoning)), max(c, len(content)))
        return reasoning[r:], content[c:]


def thinking_first(grammar: str, opened_: bool = False) -> str:
    """llguidance's grammar (its JSON form): a think block (any text), then `grammar`'s
    language. `grammar` is Lark text or llguidance's JSON form (runtime/grammar.py
    grammar_text: what every structure compiles to); its first grammar becomes the nested
    grammar the think block leads into (`@answer`, or its own name)."""
    form = json.loads(grammar) if grammar.lstrip().startswith("{") else None
    grammars = (form["grammars"] if isinstance(form, dict) and form.get("grammars")
                else [{"lark_grammar": grammar}])
    name = grammars[0].get("name") or "answer"
    think = (f'think[lazy]: /(.|\\n)*/ {json.dumps(CLOSE)}' if opened_ else
             f'think[lazy]: {json.dumps(OPEN)} /(.|\\n)*/ {json.dumps(CLOSE)}')
    top = "\n".join([f"start: think SPACE @{name}", think, "SPACE: /[ \\t\\n]*/"])
    return json.dumps({"grammars": [{"lark_grammar": top}, {**grammars[0], "name": name},
                                    *grammars[1:]]})


def after_thinking(params, opened_: bool = False):
    """SamplingParams held to a structure (a JSON schema, a regex, a grammar, choices, the
    tool-call grammar): held to it after a think block instead. No structure: unchanged."""
    from trt_spec.runtime.grammar import grammar_text

    structure = params.structure
    if structure is None:
        return params
    kind, value = structure
    inner = grammar_text(kind, json.loads(value) if kind == "json_schema" else value)
    return dataclasses.replace(params, json_schema=None, regex=None, choice=(),
                               grammar=thinking_first(inner, opened_))
