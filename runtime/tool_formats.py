"""The tool-call formats of models with a call syntax of their own, and the choice of a
template's format (`format_of`; the tag formats, `template` and `block`, are
runtime/tool_calls.py's). Each is chosen from what the template writes (the special tokens
a template writes are its model's), never from the model's name:

    llama3        the template writes a call as {"name": ..., "parameters": {...}} (Llama 3.1,
                  3.2, 3.3): the model answers that JSON (after <|python_tag|> or not),
                  several separated by "; "
    mistral       the template writes [TOOL_CALLS] (Mistral 7B v0.3, Nemo, Small 3.1): the
                  model answers [TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]
    mistral-args  the template writes [TOOL_CALLS]name[ARGS] (Small 3.2, Magistral,
                  Devstral): [TOOL_CALLS]name[ARGS]{...} per call

Each gives the template the tools and the tool turns as they are (Mistral's with the
9-character call ids its templates require). The markers calls start with (<|python_tag|>,
[TOOL_CALLS], [ARGS], [CALL_ID]) are special tokens: they stay in the output's text
(`Format.markers`, Tokenizer.keep_special), where the parser reads them, and the call
grammar names them by their ids (a literal "[TOOL_CALLS]" is plain bytes to llguidance,
which the special token is not).
"""

from __future__ import annotations

import hashlib
import json
import re

from trt_spec.runtime.grammar import JSON_OPTIONS
from trt_spec.runtime.tool_calls import (FORMATS, Format, TemplateFormat, Tool, ToolCall,
                                         call_schema, held_from)


class NativeFormat(TemplateFormat):
    """A model's own call syntax, which its template writes: the template is given the tools
    and the tool turns as they are; `writes` says whether a template writes this syntax."""

    def writes(self, chat_template: str) -> bool:
        raise NotImplementedError


class LlamaFormat(NativeFormat):
    """Llama 3.1 / 3.2 / 3.3: the answer is the call, {"name": ..., "parameters": {...}}
    (after <|python_tag|> or not; "arguments" read too), several separated by "; "."""

    name, open, close, markers = "llama3", "", "", ("<|python_tag|>",)

    def writes(self, chat_template: str) -> bool:
        return '"parameters": ' in chat_template and "<|eot_id|>" in chat_template

    def held_from(self, text: str, sent: int) -> int:
        """A call is the whole answer: held while the answer may still become one."""
        head = text.lstrip()
        opens = head[:1] == "{" or PYTHON_TAG.startswith(head) or head.startswith(PYTHON_TAG)
        return 0 if opens else len(text)

    def start_rule(self, parallel, ids):
        return 'start: call ("; " call)*' if parallel else "start: call"

    def call_rule(self, t, ids):
        return f"%json {json.dumps(call_schema(t, 'parameters'))}"

    def parse(self, text, given, held=False):
        body = text.strip()
        body = body[len(PYTHON_TAG):].lstrip() if body.startswith(PYTHON_TAG) else body
        objects, cut = json_sequence(body, ";")
        calls = [call_of(o, {t.name for t in given}, ("parameters", "arguments"))
                 for o in objects]
        if not calls or None in calls or (cut and not held):
            return text, []
        return None, calls


class MistralFormat(NativeFormat):
    """Mistral 7B v0.3, Nemo, Small 3.1: [TOOL_CALLS] then a JSON list of
    {"name", "arguments"}, spaced as the template writes it ("[TOOL_CALLS] [" in 7B v0.3
    and Small 3.1, "[TOOL_CALLS][" in Nemo)."""

    name, open, close, markers = "mistral", "[TOOL_CALLS]", "", ("[TOOL_CALLS]",)

    def __init__(self, space: str = ""):
        self.space = space  # between [TOOL_CALLS] and the list

    def writes(self, chat_template: str) -> bool:
        return self.open + self.space + "[" in chat_template if self.space \
            else self.open in chat_template

    def messages(self, messages: list[dict], given: list[Tool]) -> list[dict]:
        return [mistral_ids(m) for m in messages]

    def held_from(self, text: str, sent: int) -> int:
        return held_from(text, sent, self.open)

    def start_rule(self, parallel, ids):
        calls = 'call (", " call)*' if parallel else "call"
        return f'start: {token(self.open, ids)} {json.dumps(self.space + "[")} {calls} "]"'

    def call_rule(self, t, ids):
        return f"%json {json.dumps(call_schema(t))}"

    def parse(self, text, given, held=False):
        head, sep, rest = text.partition(self.open)
        if not sep:
            return text, []
        rest = rest.strip()
        try:
            listed = json.loads(rest)
        except (ValueError, RecursionError):
            if not (held and rest.startswith("[")):
                return text, []
            listed = json_sequence(rest[1:], ",")[0]  # cut short (max_tokens): its whole calls
        listed = listed if isinstance(listed, list) else [listed]
        calls = [call_of(o, {t.name for t in given}, ("arguments",)) for o in listed]
        if not calls or None in calls:
            return text, []
        return head.strip() or None, calls


class MistralArgsFormat(MistralFormat):
    """Mistral Small 3.2, Magistral, Devstral: [TOOL_CALLS]name[ARGS]{...} per call
    ([CALL_ID]id before [ARGS] read too)."""

    name, markers = "mistral-args", ("[TOOL_CALLS]", "[ARGS]", "[CALL_ID]")

    def writes(self, chat_template: str) -> bool:
        return "[ARGS]" in chat_template

    def start_rule(self, parallel, ids):
        return "start: call+" if parallel else "start: call"

    def call_rule(self, t, ids):
        schema = {**t.parameters, "x-guidance": JSON_OPTIONS}
        return f"{token(self.open, ids)} {json.dumps(t.name)} {token('[ARGS]', ids)} " \
               f"%json {json.dumps(schema)}"

    def parse(self, text, given, held=False):
        head, *blocks = text.split(self.open)
        if not blocks:
            return text, []
        calls = []
        for i, block in enumerate(blocks):
            name, sep, args = block.partition("[ARGS]")
            name = name.split("[CALL_ID]")[0].strip()
            objects, cut = json_sequence(args.strip(), None)
            call = call_of({"name": name, "arguments": objects[0]}, {t.name for t in given},
                           ("arguments",)) if sep and len(objects) == 1 else None
            if held and i == len(blocks) - 1 and (call is None or cut):
                break  # the last call, cut short (max_tokens)
            if call is None or cut:
                return text, []
            calls.append(call)
        return (head.strip() or None, calls) if calls else (text, [])


PYTHON_TAG = "<|python_tag|>"


def token(text: str, ids: dict[str, int] | None) -> str:
    """A marker in Lark: the special token by its id where the tokenizer has it, else the
    text."""
    return f"<[{ids[text]}]>" if ids and text in ids else json.dumps(text)


def json_sequence(text: str, separator: str | None) -> tuple[list, bool]:
    """The JSON values `text` is made of, one after another (`separator` and whitespace
    between), and whether it ends in one cut short or in something not JSON."""
    decoder, values, at = json.JSONDecoder(), [], 0
    while at < len(text):
        try:
            value, at = decoder.raw_decode(text, at)
        except (ValueError, RecursionError):
            return values, True
        values.append(value)
        rest = text[at:].lstrip()
        if separator and rest.startswith(separator):
            rest = rest[len(separator):].lstrip()
        at = len(text) - len(rest)
    return values, False


def call_of(obj, names: set[str], keys: tuple[str, ...]) -> ToolCall | None:
    """A call from a parsed {"name", <one of keys>: {...}} naming a given tool, else None."""
    if not isinstance(obj, dict) or obj.get("name") not in names:
        return None
    args = next((obj[k] for k in keys if k in obj), {})
    if not isinstance(args, dict):
        return None
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


def mistral_ids(m: dict) -> dict:
    """A turn with its call ids as Mistral's templates require them: 9 letters or digits
    (the id's own last 9 where it has them, else a hash of it; a call and its result alike)."""
    def short(call_id: str) -> str:
        kept = "".join(c for c in call_id if c.isascii() and c.isalnum())
        if len(kept) >= 9:
            return kept[-9:]
        return hashlib.sha256(call_id.encode()).hexdigest()[:9]

    if m.get("tool_calls"):
        return {**m, "tool_calls": [{**c, "id": short(c.get("id") or "")}
                                    for c in m["tool_calls"]]}
    if m["role"] == "tool" and "tool_call_id" in m:
        return {**m, "tool_call_id": short(m["tool_call_id"])}
    return m


# the first that fits
NATIVE = (MistralArgsFormat(), MistralFormat(" "), MistralFormat(), LlamaFormat())
# a `tools` variable read (`if tools`, `for t in tools`), not a message's key ('tools' in
# message, message['tools']: Phi-4-mini's, which the variable never reaches)
TOOLS_IN_TEMPLATE = re.compile(r"(?<![\w'\".])tools\b(?!['\"])")


def format_of(chat_template: str | None) -> Format:
    """The template's format: a model's own where the template writes its calls that way
    (Llama 3.x's JSON, Mistral's [TOOL_CALLS]: `NATIVE`), else `template`
    where it reads a `tools` variable, else `block`."""
    for fmt in NATIVE:
        if chat_template and fmt.writes(chat_template):
            return fmt
    if chat_template and TOOLS_IN_TEMPLATE.search(chat_template):
        return FORMATS["template"]
    return FORMATS["block"]


def needs_rendering(messages: list[dict]) -> bool:
    return any(m["role"] == "tool" or m.get("tool_calls") for m in messages)


def for_template(chat_template: str | None, messages: list[dict], given: list[Tool]
                 ) -> tuple[list[dict], dict]:
    """(the messages, the template's extra variables) to render a chat with `given` tools
    (none: a chat that may hold earlier tool turns)."""
    fmt = format_of(chat_template)
    listed = fmt.template_tools(given)
    return fmt.messages(messages, given), ({"tools": listed} if listed else {})
