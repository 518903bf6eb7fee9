"""Tool calling: the tools shown to the model, its calls held to them, and parsed back.

A request's `tools` (OpenAI's [{"type": "function", "function": {"name", "description",
"parameters": JSON schema}}]) reach the model in the format its chat template writes calls
in, chosen from the template (never from the model's name: runtime/tool_formats.py
`format_of`). Models with a call syntax of their own (Llama 3.x's JSON, Mistral's
[TOOL_CALLS]) have theirs in runtime/tool_formats.py; the two tag formats are here:

    template   the template takes `tools` itself (Qwen2.5 / Qwen3: `{%- if tools %}`): the
               tools and the tool turns go to it as they are; it writes a call as
               <tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>
    block      any other template (SmolLM2, Gemma 3: no tool section, content read as a
               string): a system block lists the tools and says how to call one,
               <tool_call>{"name": ..., "arguments": {...}}</tool_call>; an assistant's
               earlier calls are written that way, and tool results become user turns
               <tool_response>...</tool_response>, before the template sees them

Both write calls between the same tags, so one parser reads both (`Format.parse`). Under
tool_choice "required" or a named function the output is held to a grammar of the allowed
calls (`Format.grammar`: llguidance's Lark with each call's JSON schema inline), so every
call parses and its arguments validate; the tokens it forces are drafted for free. Under
"auto" the model chooses, and a call that does not parse comes back as text.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

from trt_spec.runtime.grammar import JSON_OPTIONS
from trt_spec.runtime.validation import FieldError, _show

OPEN, CLOSE = "<tool_call>", "</tool_call>"
# tool_choice's words (besides naming a function): what each lets the model do
CHOICES = {"none": "no call", "auto": "text or calls, as it chooses", "required": "calls"}
MAX_TOOLS = 64
NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")  # OpenAI's function names


@dataclass(frozen=True)
class Tool:
    name: str
    description: str
    parameters: dict  # a JSON schema of the arguments object

    def spec(self) -> dict:
        """As OpenAI and chat templates write a tool."""
        return {"type": "function", "function": {"name": self.name,
                                                 "description": self.description,
                                                 "parameters": self.parameters}}


@dataclass(frozen=True)
class ToolChoice:
    mode: str  # none | auto | required | function
    name: str | None = None  # mode "function": the one function to call

    @property
    def forced(self) -> bool:
        """The output must be calls (held to the call grammar)."""
        return self.mode in ("required", "function")


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text of an object, as OpenAI sends it
    id: str = ""

    def __post_init__(self):
        self.id = self.id or f"call_{uuid.uuid4().hex[:24]}"

    def to_dict(self, index: int | None = None) -> dict:
        d = {"id": self.id, "type": "function",
             "function": {"name": self.name, "arguments": self.arguments}}
        return d if index is None else {"index": index, **d}


def tools(value, field: str = "tools") -> list[Tool]:
    """OpenAI's `tools`, checked: function tools with unique names and object schemas."""
    if not isinstance(value, list) or not value or len(value) > MAX_TOOLS:
        raise FieldError(field, f"{field}={_show(value)}: expected a list of 1..{MAX_TOOLS} "
                                '{"type": "function", "function": {...}} tools')
    out = []
    for i, t in enumerate(value):
        out.append(tool(t, f"{field}[{i}]"))
    names = [t.name for t in out]
    if len(set(names)) < len(names):
        dup = next(n for n in names if names.count(n) > 1)
        raise FieldError(field, f"{field}: the function name {dup!r} is given twice")
    return out


def tool(t, where: str) -> Tool:
    f = t.get("function") if isinstance(t, dict) and t.get("type") == "function" else None
    if not isinstance(f, dict):
        raise FieldError(where, f"{where}={_show(t)}: expected {{'type': 'function', "
                                "'function': {'name', 'description', 'parameters'}}")
    name = f.get("name")
    if not isinstance(name, str) or not NAME.match(name):
        raise FieldError(f"{where}.function.name", f"{where}.function.name={_show(name)}: "
                         "expected 1-64 letters, digits, _ . or -")
    params = f.get("parameters", {"type": "object", "properties": {}})
    if not isinstance(params, dict) or params.get("type", "object") != "object":
        raise FieldError(f"{where}.function.parameters", f"{where}.function.parameters="
                         f"{_show(params)}: expected a JSON schema of an object")
    description = f.get("description") or ""
    if not isinstance(description, str):
        raise FieldError(f"{where}.function.description", f"{where}.function.description="
                         f"{_show(description)}: expected a string")
    return Tool(name, description, params)


def tool_choice(value, given: list[Tool], field: str = "tool_choice") -> ToolChoice:
    """OpenAI's tool_choice: none, auto (the default with tools), required, or
    {"type": "function", "function": {"name"}} naming one of the tools."""
    if value is None:
        return ToolChoice("auto" if given else "none")
    if isinstance(value, str) and value in CHOICES:
        if value != "none" and not given:
            raise FieldError(field, f"{field}={value!r} needs tools")
        return ToolChoice(value)
    f = value.get("function") if isinstance(value, dict) else None
    name = f.get("name") if isinstance(f, dict) else None
    if not isinstance(name, str):
        raise FieldError(field, f"{field}={_show(value)}: expected one of "
                         f"{', '.join(CHOICES)} or {{'type': 'function', 'function': "
                         "{'name': ...}}")
    if name not in {t.name for t in given}:
        raise FieldError(field, f"{field} names the function {name!r}, which is not among "
                         f"the tools ({', '.join(t.name for t in given) or 'none given'})")
    return ToolChoice("function", name)


class Format:
    """How one kind of chat template is shown tools and writes calls."""

    name: str
    open: str  # what a call is written between
    close: str
    markers: tuple[str, ...] = ()  # special tokens calls are written with (kept in the text)

    def held_from(self, text: str, sent: int) -> int:
        """Where the content a stream may send ends: at a call's opening, or before a tail
        that may yet become one."""
        return held_from(text, sent, OPEN)

    def messages(self, messages: list[dict], given: list[Tool]) -> list[dict]:
        """The chat as the template is to see it."""
        return messages

    def template_tools(self, given: list[Tool]) -> list[dict] | None:
        """What the template's `tools` variable holds (None: the template is not given it)."""
        return None

    def grammar(self, given: list[Tool], choice: ToolChoice, parallel: bool,
                ids: dict[str, int] | None = None) -> str:
        """llguidance Lark: one call (or several, `parallel`) of the allowed functions, each
        one's arguments held to its schema. ids: the markers' token ids (Tokenizer.
        marker_ids): a special token is written by its id, as its text would be read as
        plain bytes."""
        allowed = [t for t in given if choice.mode != "function" or t.name == choice.name]
        rules = [f"call_{i}: {self.call_rule(t, ids)}" for i, t in enumerate(allowed)]
        calls = " | ".join(f"call_{i}" for i in range(len(allowed)))
        return "\n".join([self.start_rule(parallel, ids), f"call: {calls}", *rules])

    def start_rule(self, parallel: bool, ids) -> str:
        return 'start: call ("\\n" call)*' if parallel else "start: call"

    def call_rule(self, t: Tool, ids) -> str:
        """One call of t in Lark."""
        schema = json.dumps(call_schema(t))
        return f"{json.dumps(self.open)} %json {schema} {json.dumps(self.close)}"

    def parse(self, text: str, given: list[Tool], held: bool = False
              ) -> tuple[str | None, list[ToolCall]]:
        """(content, calls) from the model's text: the text before the first call is the
        content (None when empty). Unheld (tool_choice auto), a call that does not parse or
        names no given tool makes the whole text content, with no calls. Held to the call
        grammar (`held`), every call but one cut short (max_tokens) parses: that one is
        left out."""
        head, sep, rest = text.partition(OPEN)
        if not sep:
            return text, []
        names, calls = {t.name for t in given}, []
        blocks = rest.split(OPEN)
        for i, block in enumerate(blocks):
            body, closed, tail = block.partition(CLOSE)  # (an unclosed last call may parse)
            call = parse_call(body, names)
            last = i == len(blocks) - 1
            if held and last and call is None and not closed:
                break  # cut short
            if held and last and call is not None and OPEN.startswith(tail.strip()):
                calls.append(call)  # (the next call's tag, cut short)
                break
            if call is None or tail.strip():
                return text, []
            calls.append(call)
        return head.strip() or None, calls


def call_schema(t: Tool, arguments: str = "arguments") -> dict:
    """The JSON schema of one call of t: {"name": t.name, arguments: t's parameters}, in
    the fixed spacing of the project's JSON outputs (keys and punctuation forced)."""
    return {"type": "object", "properties": {"name": {"const": t.name},
                                             arguments: t.parameters},
            "required": ["name", arguments], "additionalProperties": False,
            "x-guidance": JSON_OPTIONS}


def held_from(text: str, sent: int, tag: str) -> int:
    """Where the content that may go out ends: at `tag`, or before a tail that may yet
    become it."""
    at = text.find(tag, sent)
    if at >= 0:
        return at
    for n in range(min(len(tag) - 1, len(text) - sent), 0, -1):
        if tag.startswith(text[len(text) - n:]):
            return len(text) - n
    return len(text)


def parse_call(body: str, names: set[str]) -> ToolCall | None:
    try:
        obj = json.loads(body)
    except (ValueError, RecursionError):  # not JSON, or nested past the parser: no call
        return None
    if not isinstance(obj, dict) or obj.get("name") not in names \
            or not isinstance(obj.get("arguments", {}), dict):
        return None
    return ToolCall(obj["name"], json.dumps(obj.get("arguments", {}), ensure_ascii=False))


class TemplateFormat(Format):
    """Templates with a tool section (Qwen2.5, Qwen3): they render tools and tool turns."""

    name, open, close = "template", OPEN + "\n", "\n" + CLOSE

    def template_tools(self, given: list[Tool]) -> list[dict] | None:
        return [t.spec() for t in given] if given else None


class BlockFormat(Format):
    """Templates without one: the tools in a system block, tool turns rendered as text."""

    name, open, close = "block", OPEN, CLOSE

    def messages(self, messages: list[dict], given: list[Tool]) -> list[dict]:
        out = [rendered_turn(m) for m in messages]
        out = merge_tool_results(out)
        if not given:
            return out
        block = tools_block(given)
        if out and out[0]["role"] in ("system", "developer"):
            return [{**out[0], "content": f"{out[0]['content']}\n\n{block}"}, *out[1:]]
        return [{"role": "system", "content": block}, *out]


def tools_block(given: list[Tool]) -> str:
    lines = ["You can call these tools. To call one, answer with only",
             f'{OPEN}{{"name": "<the tool\'s name>", "arguments": {{<its arguments>}}}}{CLOSE}',
             "one such line per call. A call's result comes back as "
             "<tool_response>...</tool_response>. The tools:"]
    lines += [json.dumps({"name": t.name, "description": t.description,
                          "parameters": t.parameters}, ensure_ascii=False) for t in given]
    return "\n".join(lines)


def rendered_turn(m: dict) -> dict:
    """An assistant's calls as the text it wrote; a tool result as a user turn. An
    assistant's reasoning stays, for a template that renders it."""
    if m["role"] == "tool":
        return {"role": "user", "content": f"<tool_response>\n{m['content']}\n</tool_response>"}
    kept = {k: v for k, v in m.items() if k in ("role", "content", "name", "reasoning_content")}
    if m.get("tool_calls"):
        calls = [OPEN + json.dumps({"name": c["function"]["name"],
                                    "arguments": c["function"]["arguments"]},
                                   ensure_ascii=False, **SEPARATORS) + CLOSE
                 for c in m["tool_calls"]]
        text = "\n".join(([m["content"]] if m["content"] else []) + calls)
        thought = {k: v for k, v in kept.items() if k == "reasoning_content"}
        return {"role": "assistant", "content": text, **thought}
    return kept


SEPARATORS = {"separators": (", ", ": ")}  # as the call grammar writes JSON


def merge_tool_results(messages: list[dict]) -> list[dict]:
    """Results of one turn's calls in one user turn (templates that alternate roles)."""
    out = []
    for m in messages:
        if out and m["role"] == "user" and out[-1]["role"] == "user" \
                and m["content"].startswith("<tool_response>") \
                and out[-1]["content"].startswith("<tool_response>"):
            out[-1] = {**out[-1], "content": out[-1]["content"] + "\n" + m["content"]}
        else:
            out.append(m)
    return out


FORMATS = {f.name: f for f in (TemplateFormat(), BlockFormat())}
