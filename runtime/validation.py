"""Checks on user input shared by the Python API and the HTTP server.

`SamplingParams`, chats and the speculative options are checked here once; the server maps a
`FieldError` onto OpenAI's error JSON (400, `param` = the field) and the Python API raises it
as is. Every message quotes the bad value and says what is allowed.
"""

from __future__ import annotations

import json
import math
from numbers import Real

ROLES = ("system", "developer", "user", "assistant", "tool")
MAX_SEED = 2**64 - 1
# a structured output's schema, regex, grammar or choices, as text: past this it is refused
# (compiling is bounded too: runtime/grammar.py)
MAX_STRUCTURE_BYTES = 64 * 1024
STRUCTURES = ("json_schema", "regex", "grammar", "choice")
# JSON nesting, in a request body and in the JSON text it carries (a schema, a call's
# arguments): a request needs 4 ({"messages": [{"content": [{...}]}]})
MAX_DEPTH = 32


class FieldError(ValueError):
    """Bad user input in one named field (`param` in OpenAI's error JSON)."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


def _show(value) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def integer(field: str, value, lo: int, hi: int | None = None, allowed: str = "") -> int:
    """An int (not a bool) in lo..hi."""
    if not isinstance(value, int) or isinstance(value, bool) or value < lo or \
            (hi is not None and value > hi):
        span = f">= {lo}" if hi is None else f"in {lo}..{hi}"
        raise FieldError(field, f"{field}={_show(value)}: must be an integer {span}{allowed}")
    return value


def real(field: str, value, allowed: str, lo: float = -math.inf,
         hi: float = math.inf) -> float:
    """A finite real number (int or float, not a bool) in [lo, hi]."""
    ok = isinstance(value, Real) and not isinstance(value, bool) and _finite(value) \
        and lo <= value <= hi
    if not ok:
        raise FieldError(field, f"{field}={_show(value)}: must be a finite number {allowed}")
    return float(value)


def _finite(value: Real) -> bool:
    """Whether a real number is a finite float (an int past float's range is not: math
    raises OverflowError for it)."""
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


def strings(field: str, value, allowed: str) -> tuple[str, ...]:
    """A string or a list / tuple of strings -> a tuple."""
    items = (value,) if isinstance(value, str) else value
    if not isinstance(items, (list, tuple)) or not all(isinstance(s, str) for s in items):
        raise FieldError(field, f"{field}={_show(value)}: expected {allowed}")
    return tuple(items)


def seed(value) -> int | None:
    if value is None:
        return None
    return integer("seed", value, 0, MAX_SEED, " (or None: a fresh seed)")


MAX_TOKEN_IDS = 1 << 20  # ids in allowed_token_ids, or in all bad words together


def token_ids(field: str, value) -> tuple[int, ...]:
    """A list / tuple of token ids (integers >= 0) -> a tuple; whether each is in the
    vocabulary is the engine's check (ids_in_vocabulary)."""
    if not isinstance(value, (list, tuple)) or len(value) > MAX_TOKEN_IDS:
        raise FieldError(field, f"{field}={_show(value)}: expected a list of token ids (at "
                                f"most {MAX_TOKEN_IDS})")
    return tuple(integer(field, t, 0) for t in value)


def token_sequences(field: str, value) -> tuple[tuple[int, ...], ...]:
    """A list of non-empty token-id lists -> a tuple of tuples."""
    if not isinstance(value, (list, tuple)) or \
            not all(isinstance(w, (list, tuple)) and w for w in value):
        raise FieldError(field, f"{field}={_show(value)}: expected a list of non-empty "
                                "token-id lists")
    out = tuple(token_ids(field, w) for w in value)
    if sum(map(len, out)) > MAX_TOKEN_IDS:
        raise FieldError(field, f"{field} holds more than {MAX_TOKEN_IDS} token ids")
    return out


def flag(field: str, value) -> bool:
    if not isinstance(value, bool):
        raise FieldError(field, f"{field}={_show(value)}: must be true or false")
    return value


def chat(messages, field: str = "messages") -> list[dict]:
    """A chat: a non-empty list of {"role", "content"} with a known role and text content (a
    string, or OpenAI's list of {"type": "text", "text"} parts, joined). Returns plain
    {"role", "content": str} dicts (a "name" is kept). Tool turns as OpenAI's: an assistant
    message may carry `tool_calls` (its content then may be null), whose arguments (JSON
    text) are returned parsed, as chat templates read them; a "tool" message carries the
    `tool_call_id` it answers. An assistant message comes back as the server answered it
    (`assistant`): its reasoning and refusal, and the fields of an answer that are null."""
    if not isinstance(messages, list) or not messages:
        raise FieldError(field, f"{field}={_show(messages)}: expected a non-empty list of "
                                "{'role', 'content'} messages")
    return [message(m, f"{field}[{i}]") for i, m in enumerate(messages)]


MESSAGE_KEYS = {"role", "content", "name", "tool_calls", "tool_call_id"}
# what an answer's message carries besides (OpenAI's and vLLM's), sent back in a chat's
# history: the reasoning (kept as reasoning_content, which chat templates read; one that
# does not render it drops it), the refusal (the content, where that is null), and fields
# this server never sets, which must then be null (annotations: dropped)
ASSISTANT_KEYS = {"reasoning_content", "reasoning", "refusal", "annotations", "audio",
                  "function_call"}


def message(m, where: str) -> dict:
    """One chat message, checked (see `chat`)."""
    assistant = isinstance(m, dict) and m.get("role") == "assistant"
    if not isinstance(m, dict) or "role" not in m or ("content" not in m and not assistant):
        raise FieldError(where, f"{where}={_show(m)}: expected {{'role': ..., "
                                "'content': ...}")
    extra = sorted(set(m) - MESSAGE_KEYS - (ASSISTANT_KEYS if assistant else set()))
    if extra:
        raise FieldError(f"{where}.{extra[0]}", f"{where} has unknown keys {extra}; a "
                                                "message has role, content and name (tool "
                                                "turns: tool_calls, tool_call_id; an "
                                                "assistant's: reasoning_content, refusal)")
    role = m["role"]
    if role not in ROLES:
        raise FieldError(f"{where}.role", f"{where}.role={_show(role)}: must be one "
                                          f"of {', '.join(ROLES)}")
    calls = m.get("tool_calls")
    content = m.get("content")
    out = {"role": role, "content": "" if content is None and (calls or assistant) else
           text_content(content, f"{where}.content")}
    for key in ("name", "tool_call_id"):
        if m.get(key) is not None:
            if not isinstance(m[key], str):
                raise FieldError(f"{where}.{key}", f"{where}.{key}={_show(m[key])}: "
                                                   "expected a string")
            out[key] = m[key]
    if calls is not None:
        if role != "assistant":
            raise FieldError(f"{where}.tool_calls", f"{where}: only an assistant message "
                                                    "carries tool_calls")
        out["tool_calls"] = tool_calls(calls, f"{where}.tool_calls")
    if role == "tool" and "tool_call_id" not in out:
        raise FieldError(f"{where}.tool_call_id", f"{where} is a tool message without "
                                                  "tool_call_id: name the call it answers")
    return assistant_fields(m, out, where) if assistant else out


def assistant_fields(m: dict, out: dict, where: str) -> dict:
    """out with an assistant message's own fields (ASSISTANT_KEYS): reasoning_content (or
    vLLM's newer name, reasoning), the refusal as the content where there is none."""
    for key in ("reasoning_content", "reasoning", "refusal"):
        if m.get(key) is not None and not isinstance(m[key], str):
            raise FieldError(f"{where}.{key}", f"{where}.{key}={_show(m[key])}: expected a "
                                               "string or null")
    thought = m.get("reasoning_content") if m.get("reasoning_content") is not None \
        else m.get("reasoning")
    if thought:
        out["reasoning_content"] = thought
    if m.get("refusal") and not out["content"] and not out.get("tool_calls"):
        out["content"] = m["refusal"]  # what the assistant said
    for key in ("audio", "function_call"):
        if m.get(key) is not None:
            raise FieldError(f"{where}.{key}", f"{where}.{key}={_show(m[key])}: must be null "
                                               "(a text-only server; tools: tool_calls)")
    if m.get("annotations") is not None and not isinstance(m["annotations"], list):
        raise FieldError(f"{where}.annotations", f"{where}.annotations="
                                                 f"{_show(m['annotations'])}: expected a "
                                                 "list or null")
    return out


def text_content(content, where: str) -> str:
    """A message's content: a string, or OpenAI's list of text parts (joined; an assistant's
    refusal part as its text)."""
    if isinstance(content, list):
        if not all(isinstance(p, dict) and isinstance(p.get(p.get("type")), str)
                   and p.get("type") in ("text", "refusal") for p in content):
            raise FieldError(where, f"{where}: only text parts "
                             '({"type": "text", "text": ...}) are supported')
        content = "".join(p[p["type"]] for p in content)
    if not isinstance(content, str):
        raise FieldError(where, f"{where}={_show(content)}: expected a string or a list of "
                                "text parts")
    return content


def tool_calls(calls, where: str) -> list[dict]:
    """An assistant's earlier calls: [{"id", "type": "function", "function": {"name",
    "arguments": JSON text of an object}}] -> the same with the arguments parsed (arguments
    already parsed are taken as they are: a chat checked twice stays the same)."""
    if not isinstance(calls, list):
        raise FieldError(where, f"{where}={_show(calls)}: expected a list of tool calls")
    out = []
    for j, c in enumerate(calls):
        at = f"{where}[{j}]"
        f = c.get("function") if isinstance(c, dict) else None
        if not isinstance(f, dict) or not isinstance(f.get("name"), str) \
                or not isinstance(f.get("arguments"), (str, dict)):
            raise FieldError(at, f"{at}={_show(c)}: expected {{'id', 'type': 'function', "
                                 "'function': {'name': str, 'arguments': JSON text}}")
        out.append({"id": c.get("id"), "type": "function",
                    "function": {"name": f["name"],
                                 "arguments": call_arguments(f["arguments"], at)}})
    return out


def call_arguments(value: str | dict, at: str) -> dict:
    if isinstance(value, str):
        value = loads(f"{at}.function.arguments", value)
    if not isinstance(value, dict):
        raise FieldError(f"{at}.function.arguments", f"{at}.function.arguments="
                         f"{_show(value)}: expected a JSON object")
    return value


def loads(field: str, text: str):
    """JSON text a request carries in a field (a schema, a call's arguments), parsed within
    the request body's own bounds: FieldError where it is not JSON (NaN and Infinity are
    not), nests past MAX_DEPTH, or holds an integer past Python's parsing limit."""
    def constant(name):
        raise ValueError(f"{name} is not JSON")

    try:
        value = json.loads(text, parse_constant=constant)
    except json.JSONDecodeError as e:
        raise FieldError(field, f"{field}={_show(text)}: not JSON (not valid JSON: {e.msg} at "
                                f"line {e.lineno} column {e.colno})") from None
    except RecursionError:
        raise FieldError(field, f"{field} nests JSON too deeply; at most {MAX_DEPTH} levels "
                                "are allowed") from None
    except ValueError as e:  # an integer of more than 4,300 digits, NaN
        raise FieldError(field, f"{field}={_show(text)}: not JSON (not valid JSON: {e})") \
            from None
    depth = json_depth(value)
    if depth > MAX_DEPTH:
        raise FieldError(field, f"{field} nests JSON {depth} levels deep; at most {MAX_DEPTH} "
                                "are allowed")
    return value


def json_depth(value) -> int:
    """Nesting depth of parsed JSON, without recursion (a scalar is 0)."""
    deepest, todo = 0, [(value, 1)]
    while todo:
        v, d = todo.pop()
        children = v.values() if isinstance(v, dict) else v if isinstance(v, list) else None
        if children is not None:
            deepest = max(deepest, d)
            todo.extend((c, d + 1) for c in children if isinstance(c, (dict, list)))
    return deepest


def _bounded(field: str, text: str) -> str:
    size = len(text.encode())
    if size > MAX_STRUCTURE_BYTES:
        raise FieldError(field, f"{field} is {size} bytes; at most {MAX_STRUCTURE_BYTES} are "
                                "accepted")
    return text


def json_schema(value) -> str | None:
    """A JSON schema (a dict, True, or its JSON text) -> its JSON text, or None. Key order is
    kept: an object's properties are written in the order the schema lists them."""
    if value is None:
        return None
    if isinstance(value, str):
        value = loads("json_schema", value)
    elif isinstance(value, dict) and json_depth(value) > MAX_DEPTH:
        raise FieldError("json_schema", f"json_schema nests {json_depth(value)} levels deep; "
                                        f"at most {MAX_DEPTH} are allowed")
    if not (isinstance(value, dict) or value is True):
        raise FieldError("json_schema", f"json_schema={_show(value)}: expected a JSON schema "
                                        "(an object)")
    return _bounded("json_schema", json.dumps(value))


def text(field: str, value) -> str | None:
    """A non-empty string (a regex, a grammar), or None."""
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        raise FieldError(field, f"{field}={_show(value)}: expected a non-empty string")
    return _bounded(field, value)


def choice(value) -> tuple[str, ...]:
    """A list of non-empty strings (() or None: no choice) -> a tuple."""
    if value is None:
        return ()
    items = strings("choice", value, "a list of strings")
    if not all(items):
        raise FieldError("choice", f"choice={_show(value)}: expected a list of non-empty "
                                   "strings")
    _bounded("choice", "".join(items))
    return items


def one_structure(given: dict) -> None:
    """At most one of STRUCTURES is set."""
    set_ = [k for k, v in given.items() if v]
    if len(set_) > 1:
        raise FieldError(set_[1], f"{' and '.join(set_)} are given; a request holds its output "
                                  "to one of json_schema, regex, grammar or choice")


MAX_LOGIT_BIAS = 100.0  # |bias| per token, as OpenAI's logit_bias


def logit_bias(value) -> tuple[tuple[int, float], ...]:
    """OpenAI's logit_bias: {token id: bias in -100..100} (ids as ints or, as JSON sends them,
    decimal strings: "1234"), or its (id, bias) pairs -> pairs sorted by id. Whether each id
    is in the vocabulary is the engine's check (Scheduler.prepare)."""
    if value is None:
        return ()
    items = value.items() if isinstance(value, dict) else value
    if not isinstance(items, (list, tuple, type({}.items()))):
        raise FieldError("logit_bias", f"logit_bias={_show(value)}: expected an object of "
                                       "token id -> bias")
    out = {}
    for pair in items:
        if not (isinstance(pair, (list, tuple)) and len(pair) == 2):
            raise FieldError("logit_bias", f"logit_bias={_show(value)}: expected an object of "
                                           "token id -> bias")
        key, bias = pair
        # (at most 20 digits: past uint64 no id can be in a vocabulary, and past 4,300 int()
        # refuses)
        token = int(key) if isinstance(key, str) and key.isascii() and key.isdigit() \
            and len(key) <= 20 else key
        if not isinstance(token, int) or isinstance(token, bool) or token < 0:
            raise FieldError("logit_bias", f"logit_bias key {_show(key)}: expected a token id "
                                           "(an integer >= 0, or its decimal string)")
        if not (isinstance(bias, Real) and not isinstance(bias, bool) and _finite(bias)
                and abs(bias) <= MAX_LOGIT_BIAS):
            raise FieldError("logit_bias", f"logit_bias[{token}]={_show(bias)}: must be a "
                                           f"finite number in -{MAX_LOGIT_BIAS:g}.."
                                           f"{MAX_LOGIT_BIAS:g}")
        out[token] = float(bias)
    return tuple(sorted(out.items()))


def bias_in_vocabulary(bias: tuple[tuple[int, float], ...], vocab: int) -> None:
    """FieldError unless every logit_bias token id is below the vocabulary size."""
    outside = [t for t, _ in bias if t >= vocab]
    if outside:
        raise FieldError("logit_bias", f"logit_bias has token ids {outside[:4]} outside the "
                                       f"vocabulary 0..{vocab - 1}")


def ids_in_vocabulary(params, vocab: int) -> None:
    """FieldError unless every token id of the params' logit_bias, allowed_token_ids and
    bad_words_ids is below the vocabulary size."""
    bias_in_vocabulary(params.logit_bias, vocab)
    for field, ids in (("allowed_token_ids", params.allowed_token_ids),
                       ("bad_words", [t for w in params.bad_words_ids for t in w])):
        outside = [t for t in ids if t >= vocab]
        if outside:
            raise FieldError(field, f"{field} has token ids {outside[:4]} outside the "
                                    f"vocabulary 0..{vocab - 1}")
