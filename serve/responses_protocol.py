"""OpenAI's Responses API request (POST /v1/responses), and its translation onto a chat
completions request, which does the work (serve/chat.py: the template, tools, grammar).

    input           a string (one user message), or items:
                      message               {"role", "content": a string or text parts}
                      function_call         an earlier call: {"call_id", "name", "arguments"}
                      function_call_output  its result: {"call_id", "output"}
                      reasoning             earlier thinking: dropped (chat templates drop it)
    instructions    a system message before the input
    tools           function tools {"type": "function", "name", "description", "parameters"}
    tool_choice     none | auto | required | {"type": "function", "name"}
    text.format     text | json_object | json_schema {"name", "schema", "strict"}
    max_output_tokens, temperature, top_p, parallel_tool_calls    chat's, renamed
    reasoning       {"effort": "none"} turns the model's thinking off (enable_thinking: false)
    top_logprobs, include ["message.output_text.logprobs"]         logprobs on output_text
    seed, speculative, token_sources                               this server's, as chat's

Stateless: nothing is stored (`store` is accepted and changes nothing), so what names stored
state is a 400 saying so (previous_response_id, conversation, prompt, item_reference,
background). A chat error names the Responses field (`Names`: messages[3] is input[2],
response_format is text.format, ...).
"""

from __future__ import annotations

import json
import re
from typing import Any

from pydantic import BaseModel

from trt_spec.serve.protocol import STRICT, ChatRequest, RequestError, Speculative

LOGPROBS = "message.output_text.logprobs"  # the `include` entry that asks for logprobs
ROLES = ("user", "assistant", "system", "developer")
TEXT_PARTS = ("input_text", "output_text", "text", "refusal")
ITEMS = ("message", "function_call", "function_call_output", "reasoning")
# what names stored state, and why each is refused
NOT_KEPT = {
    "previous_response_id": "this server keeps no responses (store: false): send the whole "
                            "conversation as input items",
    "conversation": "this server keeps no conversations: send the whole conversation as "
                    "input items",
    "prompt": "this server keeps no prompt templates: send the instructions and input",
    "background": "this server runs no background responses (nothing is kept to poll): "
                  "stream instead",
}


class ResponsesRequest(BaseModel):
    """The fields of OpenAI's Responses request this server reads; any other is a 400."""

    model_config = STRICT
    model: str
    input: Any  # a string or a list of items (chat_messages)
    instructions: str | None = None
    tools: Any = None  # function tools (chat_tools)
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    text: Any = None  # {"format": {...}, "verbosity"}
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_logprobs: int | None = None
    include: Any = None  # a list of strings; LOGPROBS acts, the rest is ignored
    reasoning: Any = None  # {"effort", "summary"}
    stream: bool | None = None
    stream_options: dict | None = None  # include_obfuscation: nothing here to obfuscate
    truncation: str | None = None  # "disabled" (the only one: input is never dropped to fit)
    max_tool_calls: int | None = None  # refused: parallel_tool_calls: false allows one call
    # stored state, refused (NOT_KEPT)
    previous_response_id: str | None = None
    conversation: Any = None
    prompt: Any = None
    background: bool | None = None
    # accepted and ignored, as on chat (protocol.IGNORED; the first of each is logged)
    store: bool | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    safety_identifier: str | None = None
    # this server's, as chat's
    seed: int | None = None
    speculative: Speculative | None = None
    token_sources: bool | None = None


class Names:
    """The chat request's field paths -> the Responses request's, for errors the chat path
    raises (RequestError.param and the paths its message quotes)."""

    FIXED = {"response_format": "text.format", "max_completion_tokens": "max_output_tokens",
             "max_tokens": "max_output_tokens", "chat_template_kwargs": "reasoning",
             "messages": "input"}

    def __init__(self):
        self.paths = dict(self.FIXED)

    def add(self, chat: str, responses: str) -> None:
        self.paths[chat] = responses

    def path(self, chat: str) -> str:
        """The Responses path of a chat path: its longest known prefix renamed."""
        for k in sorted(self.paths, key=len, reverse=True):
            if chat == k or chat.startswith((k + ".", k + "[")):
                return self.paths[k] + chat[len(k):]
        return chat

    def error(self, e: RequestError) -> RequestError:
        """`e` naming the Responses fields."""
        message = PATH.sub(lambda m: self.path(m.group(0)), e.message)
        param = None if e.param is None else self.path(e.param)
        return RequestError(message, param, e.status, e.code, e.headers)


PATH = re.compile(r"\b(messages|response_format|max_completion_tokens|max_tokens|"
                  r"chat_template_kwargs|tools\[\d+\]\.function)[\w.\[\]]*")


def check_served(req: ResponsesRequest) -> None:
    """A 400 for each field that names stored state (NOT_KEPT), and for what is not done."""
    for name, why in NOT_KEPT.items():
        value = getattr(req, name)
        if value is not None and value is not False:
            raise RequestError(f"{name}={_show(value)}: {why}", name)
    if req.truncation not in (None, "disabled"):
        raise RequestError(f"truncation={req.truncation!r}: only \"disabled\" is served (input "
                           "is never dropped to fit the context; a longer one is a 400)",
                           "truncation")
    if req.max_output_tokens is not None and req.max_output_tokens < 1:
        raise RequestError(f"max_output_tokens={req.max_output_tokens}: must be at least 1 "
                           "(null: as many as the context holds)", "max_output_tokens")
    if req.max_tool_calls is not None:
        raise RequestError(f"max_tool_calls={req.max_tool_calls}: not served; "
                           "parallel_tool_calls: false allows one call per response",
                           "max_tool_calls")


def chat_request(req: ResponsesRequest) -> tuple[ChatRequest, Names]:
    """The chat completions request that answers `req`, and how to name its fields back."""
    check_served(req)
    names = Names()
    body = {"model": req.model, "messages": chat_messages(req, names),
            "max_completion_tokens": req.max_output_tokens, "temperature": req.temperature,
            "top_p": req.top_p, "stream": req.stream, "seed": req.seed,
            "parallel_tool_calls": req.parallel_tool_calls,
            "response_format": response_format(req.text),
            "chat_template_kwargs": template_kwargs(req.reasoning),
            "tools": chat_tools(req.tools, names), "tool_choice": tool_choice(req.tool_choice),
            **logprobs(req)}
    for name in ("speculative", "token_sources", "store", "metadata", "user", "service_tier",
                 "prompt_cache_key", "safety_identifier"):
        body[name] = getattr(req, name)
    body = {k: v for k, v in body.items() if v is not None}
    try:
        return ChatRequest.model_validate(body), names
    except ValueError as e:  # a value built here from one checked above: a bug, said so
        raise RequestError(f"internal error translating the request: {e}", status=500,
                           code="internal_error") from None


def chat_messages(req: ResponsesRequest, names: Names) -> list[dict]:
    """instructions and input -> chat messages (the chat path checks them further). A
    function_call joins the assistant message before it (calls in a row are one turn);
    reasoning items are dropped."""
    messages: list[dict] = []
    if req.instructions is not None:
        names.add("messages[0]", "instructions")
        names.add("messages[0].content", "instructions")
        messages.append({"role": "system", "content": req.instructions})
    items = req.input
    if isinstance(items, str):
        names.add(f"messages[{len(messages)}]", "input")
        names.add(f"messages[{len(messages)}].content", "input")
        return messages + [{"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise RequestError(f"input={_show(items)}: expected a string or a non-empty list of "
                           f"items ({', '.join(ITEMS)})", "input")
    for i, item in enumerate(items):
        where = f"input[{i}]"
        kind = item_type(item, where)
        if kind == "reasoning":
            continue
        j = len(messages)
        if kind == "message":
            names.add(f"messages[{j}]", where)
            messages.append({"role": role(item, where),
                             "content": text_of(item.get("content"), f"{where}.content")})
        elif kind == "function_call":
            call = function_call(item, where)
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":  # the same turn
                j -= 1
                last["tool_calls"] = last.get("tool_calls") or []
            else:
                last = {"role": "assistant", "content": None, "tool_calls": []}
                messages.append(last)
                names.add(f"messages[{j}]", where)
            names.add(f"messages[{j}].tool_calls[{len(last['tool_calls'])}].function", where)
            names.add(f"messages[{j}].tool_calls[{len(last['tool_calls'])}]", where)
            last["tool_calls"].append(call)
        else:  # function_call_output
            names.add(f"messages[{j}]", where)
            names.add(f"messages[{j}].content", f"{where}.output")
            names.add(f"messages[{j}].tool_call_id", f"{where}.call_id")
            messages.append({"role": "tool", "tool_call_id": string(item, "call_id", where),
                             "content": text_of(item.get("output"), f"{where}.output")})
    if not messages:
        raise RequestError("input holds no message (only reasoning items): at least one "
                           "message is needed", "input")
    return messages


def item_type(item, where: str) -> str:
    """An input item's type (a message may leave it out)."""
    if not isinstance(item, dict):
        raise RequestError(f"{where}={_show(item)}: expected an item object "
                           f"({', '.join(ITEMS)})", where)
    kind = item.get("type", "message" if "role" in item else None)
    if kind == "item_reference":
        raise RequestError(f"{where}: an item_reference names a stored item; this server "
                           "keeps none: send the item itself", f"{where}.type")
    if kind not in ITEMS:
        raise RequestError(f"{where}.type={_show(kind)}: this server takes "
                           f"{', '.join(ITEMS)} items", f"{where}.type")
    return kind


def role(item: dict, where: str) -> str:
    value = item.get("role")
    if value not in ROLES:
        raise RequestError(f"{where}.role={_show(value)}: must be one of {', '.join(ROLES)}",
                           f"{where}.role")
    return value


def string(item: dict, key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise RequestError(f"{where}.{key}={_show(value)}: expected a string", f"{where}.{key}")
    return value


def text_of(content, where: str) -> str:
    """A message's content or a call's output: a string, or text parts (input_text,
    output_text, refusal) joined; other parts (images, files, audio) are a 400."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise RequestError(f"{where}={_show(content)}: expected a string or a list of text "
                           "parts", where)
    texts = []
    for k, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        key = "refusal" if kind == "refusal" else "text"
        if kind not in TEXT_PARTS or not isinstance(part.get(key), str):
            raise RequestError(f"{where}[{k}]={_show(part)}: only text parts are served "
                               f"({', '.join(TEXT_PARTS)}, with their text)", f"{where}[{k}]")
        texts.append(part[key])
    return "".join(texts)


def function_call(item: dict, where: str) -> dict:
    """A function_call item -> a chat tool call (its call_id is the call's id)."""
    return {"id": string(item, "call_id", where), "type": "function",
            "function": {"name": string(item, "name", where),
                         "arguments": string(item, "arguments", where)}}


def chat_tools(tools, names: Names) -> list[dict] | None:
    """Function tools {"type": "function", "name", "description", "parameters", "strict"}
    -> chat's {"type": "function", "function": {...}} (the chat path checks the rest)."""
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise RequestError(f"tools={_show(tools)}: expected a list of function tools", "tools")
    out = []
    for i, t in enumerate(tools):
        kind = t.get("type") if isinstance(t, dict) else None
        if kind != "function":
            raise RequestError(f"tools[{i}]={_show(t)}: only function tools are served "
                               '({"type": "function", "name", "description", "parameters"})',
                               f"tools[{i}]")
        names.add(f"tools[{i}].function", f"tools[{i}]")
        out.append({"type": "function", "function": {
            k: t[k] for k in ("name", "description", "parameters") if t.get(k) is not None}})
    return out or None  # an empty list: no tools, as OpenAI takes it


def tool_choice(value):
    """none | auto | required, or {"type": "function", "name"} -> chat's tool_choice."""
    if value is None or isinstance(value, str):
        return value  # the chat path names a bad word
    if isinstance(value, dict) and value.get("type") == "function" and "name" in value:
        return {"type": "function", "function": {"name": value["name"]}}
    raise RequestError(f"tool_choice={_show(value)}: expected none, auto, required or "
                       '{"type": "function", "name": ...}', "tool_choice")


def response_format(text) -> dict | None:
    """text.format -> chat's response_format; text.verbosity is accepted and ignored."""
    if text is None:
        return None
    if not isinstance(text, dict) or set(text) - {"format", "verbosity"}:
        raise RequestError(f"text={_show(text)}: expected {{\"format\": {{...}}}} (and "
                           "verbosity)", "text")
    fmt = text.get("format")
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind in ("text", "json_object"):
        return {"type": kind}
    if kind != "json_schema":
        raise RequestError(f"text.format={_show(fmt)}: expected {{\"type\": \"text\" | "
                           "\"json_object\" | \"json_schema\"}", "text.format")
    if not isinstance(fmt.get("schema"), dict):
        raise RequestError(f"text.format.schema={_show(fmt.get('schema'))}: a json_schema "
                           "format needs its schema (a JSON schema object)", "text.format.schema")
    spec = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
    return {"type": "json_schema", "json_schema": spec}


EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")


def template_kwargs(reasoning) -> dict | None:
    """reasoning.effort "none" -> {"enable_thinking": false}: the model does not think
    (where its template thinks); any other effort lets it think as it does."""
    if reasoning is None:
        return None
    effort = reasoning.get("effort") if isinstance(reasoning, dict) else "?"
    if effort is not None and effort not in EFFORTS:
        raise RequestError(f"reasoning={_show(reasoning)}: expected {{\"effort\": one of "
                           f"{', '.join(EFFORTS)}}} (summary is accepted)", "reasoning")
    return {"enable_thinking": False} if effort == "none" else None


def logprobs(req: ResponsesRequest) -> dict:
    """top_logprobs, or include's LOGPROBS -> chat's logprobs and top_logprobs."""
    include = req.include or []
    if not isinstance(include, list) or not all(isinstance(x, str) for x in include):
        raise RequestError(f"include={_show(req.include)}: expected a list of strings",
                           "include")
    if LOGPROBS not in include and req.top_logprobs is None:
        return {}
    return {"logprobs": True, "top_logprobs": req.top_logprobs}


def _show(value) -> str:
    text = json.dumps(value) if not isinstance(value, str) else repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
