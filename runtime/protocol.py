"""OpenAI request bodies: the fields this server reads, and every check on them.

Whatever a request gets wrong raises RequestError quoting the bad value and saying what is
allowed; the server answers it as OpenAI does: status 4xx and
{"error": {"message", "type", "param", "code"}}.
"""

from __future__ import annotations

import json
import math
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, ValidationError

from trt_spec.runtime.sampling import SamplingParams

MAX_STOP = 4  # stop strings per request, as OpenAI
MAX_STOP_CHARS = 256


class RequestError(Exception):
    def __init__(self, message: str, param: str | None = None, status: int = 400,
                 code: str | None = None):
        super().__init__(message)
        self.message, self.param, self.status, self.code = message, param, status, code

    def body(self) -> dict:
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        return {"error": {"message": self.message, "type": kind, "param": self.param,
                          "code": self.code}}


class Speculative(BaseModel):
    """The extension field: {"speculative": {"method": "ngram", "num_draft_tokens": 4}}."""

    model_config = ConfigDict(extra="forbid")
    method: str | None = None
    num_draft_tokens: int | None = None


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = True  # usage always comes in the final chunk


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str
    # null means the default, as in OpenAI's API (clients send "temperature": null)
    max_tokens: int | None = None
    temperature: float | None = None  # default 1
    top_p: float | None = None  # default 1
    n: int | None = None  # default 1
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    stop: Any = None  # str | list[str]; checked by hand for a clearer message
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    user: str | None = None  # accepted, unused
    # extensions (vLLM's names)
    top_k: int | None = None  # default 0 (off)
    ignore_eos: bool | None = None
    speculative: Speculative | None = None


class CompletionRequest(_Request):
    prompt: Any  # str | list[int] | [str]


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "developer", "user", "assistant"]
    content: Any  # str | [{"type": "text", "text": ...}]
    name: str | None = None


class ChatRequest(_Request):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None


def parse_body(raw: bytes, model: type[BaseModel]) -> BaseModel:
    """Raw request bytes -> a request object, or RequestError saying what is wrong."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise RequestError(f"the request body is not valid UTF-8: byte {raw[e.start]:#04x} at "
                           f"offset {e.start}; send UTF-8 JSON") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise RequestError(f"the request body is not valid JSON: {e.msg} at line {e.lineno} "
                           f"column {e.colno}") from None
    if not isinstance(data, dict):
        raise RequestError(f"the request body must be a JSON object, got {type(data).__name__}")
    check_utf8(data)
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise validation_error(e, model) from None


def check_utf8(value, path: str = "") -> None:
    """JSON escapes can smuggle lone surrogates (\\ud800) that are not valid UTF-8."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as e:
            raise RequestError(f"{path or 'a string'} holds {value[e.start]!r} (a lone "
                               "surrogate), which is not valid UTF-8", path or None) from None
    elif isinstance(value, dict):
        for k, v in value.items():
            check_utf8(k, path)
            check_utf8(v, f"{path}.{k}" if path else str(k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            check_utf8(v, f"{path}[{i}]")


def validation_error(e: ValidationError, model: type[BaseModel]) -> RequestError:
    err = e.errors()[0]
    loc = ".".join(str(x) for x in err["loc"])
    if err["type"] == "extra_forbidden":
        return RequestError(f"unknown field {loc!r}; accepted fields: "
                            f"{', '.join(model.model_fields)}", loc)
    if err["type"] == "missing":
        return RequestError(f"missing required field {loc!r}", loc)
    return RequestError(f"{loc}: {err['msg']} (got {err.get('input')!r})", loc)


def chat_messages(req: ChatRequest) -> list[dict]:
    if not req.messages:
        raise RequestError("messages is empty: at least one message is needed", "messages")
    out = []
    for i, m in enumerate(req.messages):
        content = m.content
        if isinstance(content, list):  # [{"type": "text", "text": ...}, ...]
            if not all(isinstance(p, dict) and p.get("type") == "text"
                       and isinstance(p.get("text"), str) for p in content):
                raise RequestError(f"messages[{i}].content: only text parts "
                                   '({"type": "text", "text": ...}) are supported',
                                   f"messages[{i}].content")
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise RequestError(f"messages[{i}].content is {content!r}: expected a string or a "
                               "list of text parts", f"messages[{i}].content")
        out.append({"role": m.role, "content": content})
    return out


def completion_prompt(req: CompletionRequest) -> str | list[int]:
    """The prompt as text, or as token ids."""
    p = req.prompt
    if isinstance(p, list) and len(p) == 1 and isinstance(p[0], str):
        p = p[0]
    if isinstance(p, str):
        if not p:
            raise RequestError("prompt is empty: at least one token is needed", "prompt")
        return p
    if isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool)
                                         for t in p):
        return p
    raise RequestError(f"prompt {str(p)[:80]!r}: expected a non-empty string, one string in a "
                       "list, or a list of token ids (one prompt per request)", "prompt")


def stop_strings(stop) -> tuple[str, ...]:
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise RequestError(f"stop={stop!r}: expected a string or a list of strings", "stop")
    if len(stops) > MAX_STOP:
        raise RequestError(f"stop has {len(stops)} strings; at most {MAX_STOP} are allowed",
                           "stop")
    for s in stops:
        if not s or len(s) > MAX_STOP_CHARS:
            raise RequestError(f"stop string {s[:40]!r} has {len(s)} characters; each must "
                               f"have 1..{MAX_STOP_CHARS}", "stop")
    return tuple(stops)


def sampling_params(req: _Request, max_tokens: int | None, default_max_tokens: int) \
        -> SamplingParams:
    """Checks the sampling fields (each error names the field and the allowed range)."""
    n = 1 if req.n is None else req.n
    temperature = 1.0 if req.temperature is None else req.temperature
    top_p = 1.0 if req.top_p is None else req.top_p
    top_k = req.top_k or 0
    if n != 1:
        raise RequestError(f"n={n}: only n=1 is supported", "n")
    if not (temperature >= 0 and math.isfinite(temperature)):
        raise RequestError(f"temperature={temperature}: must be >= 0 (0 = greedy)",
                           "temperature")
    if not 0 < top_p <= 1:
        raise RequestError(f"top_p={top_p}: must be in (0, 1]", "top_p")
    if top_k < 0:
        raise RequestError(f"top_k={top_k}: must be >= 0 (0 = off)", "top_k")
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(req, name):
            raise RequestError(f"{name}={getattr(req, name)}: not supported (only 0)", name)
    if max_tokens is not None and max_tokens < 1:
        raise RequestError(f"max_tokens={max_tokens}: must be >= 1", "max_tokens")
    return SamplingParams(max_tokens=max_tokens or default_max_tokens, temperature=temperature,
                          top_k=top_k, top_p=top_p, seed=req.seed, stop=stop_strings(req.stop),
                          ignore_eos=bool(req.ignore_eos))
