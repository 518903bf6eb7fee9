"""A request body's bytes -> a request object: UTF-8, JSON (no NaN, no integer past int64,
nesting bounded), then the pydantic model; each refusal a RequestError naming what is wrong."""

from __future__ import annotations

import json

from pydantic import BaseModel, ValidationError

from trt_spec.runtime import validation
from trt_spec.serve.protocol import INT64, MAX_DEPTH, RequestError


def parse_body(raw: bytes, model: type[BaseModel]) -> BaseModel:
    """Raw request bytes -> a request object, or RequestError saying what is wrong."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise RequestError(f"the request body is not valid UTF-8: byte {raw[e.start]:#04x} at "
                           f"offset {e.start}; send UTF-8 JSON") from None
    try:
        data = load_json(text)
    except json.JSONDecodeError as e:
        raise RequestError(f"the request body is not valid JSON: {e.msg} at line {e.lineno} "
                           f"column {e.colno}") from None
    except RecursionError:
        raise RequestError(f"the request body nests JSON too deeply; at most {MAX_DEPTH} "
                           "levels are allowed") from None
    except ValueError as e:  # NaN, Infinity
        raise RequestError(f"the request body is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise RequestError(f"the request body must be a JSON object, got {type(data).__name__}")
    depth = validation.json_depth(data)
    if depth > MAX_DEPTH:
        raise RequestError(f"the request body nests JSON {depth} levels deep; at most "
                           f"{MAX_DEPTH} are allowed")
    check_utf8(data)
    check_integers(data)
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise validation_error(e, model) from None


def load_json(text: str):
    """json.loads, NaN and Infinity refused. An integer of more than 4,300 digits (which
    Python refuses to parse) is kept as text (LongInt), for check_integers to name its
    field: read again with a hook only then, as a hook costs per integer."""
    try:
        return json.loads(text, parse_constant=not_json)
    except ValueError as e:
        if isinstance(e, json.JSONDecodeError) or "digits" not in str(e):
            raise
    return json.loads(text, parse_int=LongInt.parse, parse_constant=not_json)


def not_json(name: str):
    raise ValueError(f"{name} is not JSON (JSON numbers are finite)")


class LongInt(str):
    """A JSON integer of more digits than any int64 has, kept as its text: Python refuses to
    parse one of more than 4,300 digits (a ValueError), and none of them fits a field."""

    @staticmethod
    def parse(digits: str):
        return int(digits) if len(digits) <= 20 else LongInt(digits)


def check_integers(value, path: str = "") -> None:
    """RequestError naming the first integer outside int64 (seed: its own check, uint64)."""
    if isinstance(value, LongInt) or (type(value) is int and path != "seed"
                                      and not INT64[0] <= value <= INT64[1]):
        shown = f"an integer of {len(value.lstrip('-'))} digits" if isinstance(value, LongInt) \
            else str(value)
        raise RequestError(f"{path or 'a value'}={shown}: past int64 "
                           f"({INT64[0]}..{INT64[1]}), more than any field takes",
                           path or None)
    if isinstance(value, dict):
        for k, v in value.items():
            check_integers(v, f"{path}.{k}" if path else str(k))
    elif isinstance(value, list):
        if value and all(type(v) is int for v in value) and \
                INT64[0] <= min(value) and max(value) <= INT64[1]:
            return  # a token-id list, at C speed
        for i, v in enumerate(value):
            check_integers(v, f"{path}[{i}]")


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
    elif isinstance(value, list) and not all(type(v) is int for v in value):
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
