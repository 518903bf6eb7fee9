"""Hypothesis strategies for requests to `trt-spec serve`, built from its own request models.

Every field of CompletionRequest, ChatRequest (serve/protocol.py), TokenizeRequest and
DetokenizeRequest (serve/tokenize.py) is drawn from its annotation in `model_fields` (an
`int | None` field gets integers, a `bool` field booleans, ...) or, for the fields typed Any,
from a strategy that knows their shape (prompt, messages, stop, logit_bias, the structures,
tools); each is mixed with hostile values a client can send:

    integers     past int64, of thousands of digits, negative token ids, ids past the vocabulary
    floats       1e400, subnormals (1e-310), -0.0, NaN / Infinity as JSON text
    strings      long, odd unicode, lone surrogates (written as \\ud800 escapes)
    structure    wrong types, nesting deep in the body and in JSON-text fields, self-recursive
                 $ref schemas, huge choice lists, empty-language regexes, bad grammars
    template     chat_template_kwargs named like the renderer's own variables

A body is clean (values each field accepts: CLEAN), clean but for one or two edge fields
(what reaches the code past the first check), or mixed throughout. ROUTES holds one
strategy per route, plus `sampling` (a speculating request with its sampling controls at the
edge: subnormal, tiny, huge), `logprobs` (echo, logprobs, prompt_logprobs, n and stream
together, on token-id prompts too) and `heavy` (the most work one request may ask for: n,
several long prompts, every logprob, prompt logprobs, echo).

A request is a `Call` (method, path, raw body bytes): the body is written as JSON text by
`dump`, so a value Python's encoder would refuse or round (1e400, NaN, a 5,000-digit integer)
goes on the wire as a client would write it. Generated max_tokens stay small (0..8 mostly) so
10,000 requests take minutes on the tiny model (vocabulary 128, context 256).

`verdict` reads a response: a 5xx, an error event in a 200 stream that blames the server, or a
body that is not JSON is a failure; any 4xx is a refusal, as it must be.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from types import NoneType, UnionType
from typing import Union, get_args, get_origin

from hypothesis import strategies as st

from trt_spec.serve.protocol import ChatRequest, CompletionRequest
from trt_spec.serve.tokenize import DetokenizeRequest, TokenizeRequest

MODEL = "tiny"  # tests/server_util.py's --served-model-name
VOCAB = 128  # tests/conftest.py TINY_HF_CONFIG
WORDS = ["a", "b", "c", "user", "w7", "w42", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]
RESERVED_TEMPLATE = ["messages", "tools", "add_generation_prompt", "bos_token", "eos_token",
                     "self", "range", "raise_exception", "namespace", "loop", "cycler",
                     "joiner", "lipsum", "dict", "__class__", "strftime_now"]
# the routes a tally names; any other path counts as "(other paths)"
KNOWN = {"/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize", "/health",
         "/metrics", "/v1/models", "/tokenizer_info", "/"}


@dataclass(frozen=True)
class Raw:
    """JSON text written as is: 1e400, NaN, a number of 5,000 digits."""

    text: str


@dataclass(frozen=True)
class Call:
    """One request: what the fuzzer sends, and what a finding quotes."""

    method: str
    path: str
    body: bytes | None = None

    @property
    def route(self) -> str:
        """What a tally counts it under: the route, or "GET (other paths)"."""
        path = self.path.split("?")[0]
        return f"{self.method} {path if path in KNOWN else '(other paths)'}"

    def __repr__(self) -> str:
        return self.show(600)

    def show(self, limit: int) -> str:
        """The call as text, its body cut at `limit` bytes."""
        body = "" if self.body is None else f" {self.body[:limit].decode('utf-8', 'replace')}"
        return f"{self.method} {self.path}{body}"


def dump(value) -> str:
    """JSON text of `value`, Raw parts verbatim; lone surrogates become \\udxxx escapes."""
    if isinstance(value, Raw):
        return value.text
    if isinstance(value, dict):
        return "{" + ", ".join(f"{json.dumps(str(k))}: {dump(v)}" for k, v in value.items()) \
            + "}"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(dump(v) for v in value) + "]"
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")
    return json.dumps(value)  # ensure_ascii: a lone surrogate is written as an escape


# -- hostile values, by kind ------------------------------------------------------------------

huge_ints = st.one_of(
    st.sampled_from([2**63, -2**63 - 1, 2**64, 2**64 - 1, 2**31, -1, -2**31, 10**30]),
    st.integers(min_value=2**63), st.integers(max_value=-2**63 - 1),
    st.integers(100, 6000).map(lambda n: Raw("9" * n)),  # thousands of digits
    st.integers(100, 6000).map(lambda n: Raw("-" + "1" * n)))
odd_floats = st.one_of(
    st.sampled_from([Raw("1e400"), Raw("-1e400"), Raw("NaN"), Raw("Infinity"),
                     Raw("-Infinity"), Raw("1e-310"), Raw("-1e-310"), Raw("5e-324"),
                     Raw("1e-320"), Raw("-0.0"), Raw("1e308"), Raw("-1e308"),
                     Raw("0." + "0" * 400 + "1"), Raw("1" + "0" * 400 + ".5")]),
    st.floats(allow_nan=False, allow_infinity=False, allow_subnormal=True))
odd_text = st.one_of(
    st.text(max_size=40),
    st.sampled_from(["\ud800", "a\udfffb", "\x00", "\u202e", "\ufeff", "🦀" * 50, "é" * 300,
                     "\u0301" * 200, "<|im_start|> system", "</s>", "{{ 7*7 }}", "{% raw %}"]),
    st.integers(1000, 200_000).map(lambda n: "a " * (n // 2)))


def nested(depth: int, leaf="x"):
    """[[[...leaf...]]] `depth` levels deep, as JSON text (past the parser's limit too)."""
    return Raw("[" * depth + json.dumps(leaf) + "]" * depth)


deep = st.one_of(st.integers(5, 60).map(nested),
                 st.integers(200, 3000).map(nested),
                 st.integers(5, 60).map(lambda d: Raw('{"a": ' * d + "1" + "}" * d)))
wrong_types = st.one_of(st.none(), st.booleans(), st.just([]), st.just({}), st.just(""),
                        st.just("1"), st.just([1, "a", None]), st.just({"a": {"b": [None]}}))
hostile = st.one_of(huge_ints, odd_floats, odd_text, wrong_types, deep)

# -- valid values, by field -------------------------------------------------------------------

token_ids = st.one_of(st.integers(0, VOCAB - 1),  # mostly in the vocabulary
                      st.integers(0, VOCAB - 1),
                      st.sampled_from([-1, -2**31, VOCAB, VOCAB + 1, 2**31, 2**63, 2**64]),
                      huge_ints)
words = st.lists(st.sampled_from(WORDS), min_size=1, max_size=12).map(" ".join)
prompts = st.one_of(words, odd_text, st.lists(words, min_size=1, max_size=3),
                    st.lists(token_ids, min_size=1, max_size=12),
                    st.lists(st.lists(token_ids, min_size=1, max_size=8), min_size=1,
                             max_size=3),
                    st.just([]), st.just([[]]), st.just(""), st.lists(words, max_size=200))
roles = st.one_of(st.sampled_from(["user", "system", "assistant", "tool", "developer"]),
                  st.text(max_size=8))
content = st.one_of(words, odd_text,
                    st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": words}),
                             max_size=3),
                    st.just([{"type": "image_url", "image_url": {"url": "http://x"}}]),
                    st.none())
tool_call = st.fixed_dictionaries({
    "id": st.text(max_size=8), "type": st.just("function"),
    "function": st.fixed_dictionaries({"name": st.sampled_from(["f", "get", ""]),
                                       "arguments": st.one_of(st.just('{"a": 1}'),
                                                              st.just("not json"),
                                                              st.just("[" * 500 + "]" * 500),
                                                              st.just({"a": 1}))})})
message = st.fixed_dictionaries(
    {"role": roles, "content": content},
    optional={"name": st.text(max_size=8), "tool_calls": st.lists(tool_call, max_size=2),
              "tool_call_id": st.text(max_size=8), "extra": st.integers()})
messages = st.one_of(st.lists(message, min_size=1, max_size=4),
                     st.lists(st.fixed_dictionaries({"role": st.just("user"),
                                                     "content": words}), min_size=1,
                              max_size=3),
                     st.just([]), st.lists(message, min_size=50, max_size=60))


def schema(depth: int = 3):
    """JSON schemas: plain ones, self-recursive $ref, huge enums, bad ones."""
    leaf = st.sampled_from([{"type": "string"}, {"type": "integer"}, {"type": "boolean"},
                            {"type": "number", "minimum": 1e308}, {"enum": ["a", "b"]},
                            {"type": "string", "pattern": "a{5,}b"}, {"type": "null"},
                            {"type": "string", "minLength": 10**9}, {"not": {}},
                            {"type": "integer", "minimum": 5, "maximum": 1}])
    objects = st.recursive(leaf, lambda inner: st.one_of(
        st.dictionaries(st.sampled_from(["a", "b", "c"]), inner, max_size=3).map(
            lambda p: {"type": "object", "properties": p, "required": list(p)}),
        st.builds(lambda i: {"type": "array", "items": i}, inner),
        st.lists(inner, min_size=1, max_size=3).map(lambda xs: {"anyOf": xs})),
        max_leaves=6)
    return st.one_of(
        objects, st.just({"type": "object"}),
        st.just({"$ref": "#"}),  # refers to itself, producing nothing
        st.just({"$defs": {"n": {"type": "object", "properties": {"next": {"$ref": "#/$defs/n"}},
                                 "required": ["next"]}}, "$ref": "#/$defs/n"}),
        st.just({"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}},
                 "$ref": "#/$defs/a"}),
        st.just({"$ref": "#/nowhere"}), st.just({"type": "nope"}),
        st.integers(100, 5000).map(lambda n: {"enum": [f"v{i}" for i in range(n)]}),
        st.integers(10, 200).map(lambda n: Raw('{"type": "array", "items": ' * n
                                               + "{}" + "}" * n)),
        st.integers(40, 400).map(lambda n: '{"items": ' * n + "{}" + "}" * n),  # JSON text
        hostile)


regexes = st.one_of(st.sampled_from(["[ab]+", "a{3}", "(a|b)*c", "[^\\x00-\\x{10FFFF}]", "a&b",
                                     "(?!a)a", "[]", "a{1000000}", "(((((((((a)))))))))*",
                                     "\\", "(", "x{2,1}", ".*", "", "[a-z]{1,64}@x\\.com"]),
                    st.text(max_size=20))
grammars = st.one_of(st.sampled_from([
    'start: "a" | "b"', "start: start", 'start: x\nx: x "a"', "start: ", "%import common.INT",
    'start: "a"+', "start: /[a-z]+/", "not a grammar {", 'start: "' + "a" * 5000 + '"']),
    st.text(max_size=30))
choices = st.one_of(st.lists(words, min_size=1, max_size=5),
                    st.integers(100, 4000).map(lambda n: [f"c{i}" for i in range(n)]),
                    st.just([]), st.just([""]), st.lists(st.integers(), max_size=3))
response_formats = st.one_of(
    st.sampled_from([{"type": "text"}, {"type": "json_object"}, {"type": "nope"}, {}]),
    schema().map(lambda s: {"type": "json_schema", "json_schema": {"name": "x", "schema": s}}),
    st.just({"type": "json_schema", "json_schema": {"name": "x"}}))
logit_bias = st.one_of(
    st.dictionaries(st.one_of(st.integers(-5, VOCAB + 5).map(str),
                              st.sampled_from(["-1", "1e3", "0x10", " 3", "99999999999999999999",
                                               "9" * 5000, "", "a", "٣"])),
                    st.one_of(st.floats(-100, 100), st.sampled_from([-100, 100, 101, -1e9]),
                              odd_floats, st.just("1")), max_size=4),
    st.just({str(i): 100 for i in range(VOCAB)}),  # every token pushed
    st.just({str(i): -100 for i in range(VOCAB)}))  # every token banned
tools = st.one_of(
    st.lists(st.fixed_dictionaries({"type": st.just("function"), "function": st.fixed_dictionaries(
        {"name": st.sampled_from(["f", "get_weather", "", "a b"]),
         "parameters": schema()}, optional={"description": odd_text})}), min_size=1,
        max_size=3),
    st.just([]), st.just([{"type": "function"}]))
tool_choices = st.one_of(st.sampled_from(["none", "auto", "required", "always"]),
                         st.just({"type": "function", "function": {"name": "f"}}),
                         st.just({"type": "function", "function": {"name": "missing"}}))
template_kwargs = st.one_of(
    st.dictionaries(st.sampled_from(RESERVED_TEMPLATE + ["enable_thinking", "x", "1a"]),
                    st.one_of(st.booleans(), st.integers(), odd_text), max_size=3),
    st.just({"enable_thinking": False}))
speculative = st.fixed_dictionaries({}, optional={
    "method": st.sampled_from(["none", "vanilla", "ngram", "suffix", "hybrid", "eagle3", "x"]),
    "num_draft_tokens": st.one_of(st.integers(-1, 10), st.sampled_from(["auto", "auto:3",
                                                                        "auto:0", "x"]))})

# the sampling controls' edge: subnormal and tiny values make a distribution non-finite
tiny_floats = st.sampled_from([0, 0.0, Raw("-0.0"), 1e-8, 1e-45, Raw("1e-310"), Raw("5e-324"),
                               Raw("-1e-310"), 2.2250738585072014e-308])

# fields whose annotation says little (Any) or whose valid range is narrow
BY_NAME = {
    "model": st.one_of(st.just(MODEL), st.just(MODEL), st.text(max_size=10)),
    "prompt": prompts, "messages": messages,
    "max_tokens": st.one_of(st.integers(0, 8), st.integers(0, 8), st.integers(-2, 300)),
    "max_completion_tokens": st.integers(0, 8),
    "n": st.one_of(st.integers(1, 3), st.integers(-1, 300)),
    "temperature": st.one_of(st.floats(0, 2), tiny_floats),
    "top_p": st.one_of(st.floats(0, 1), tiny_floats), "min_p": st.one_of(st.floats(0, 1),
                                                                         tiny_floats),
    "top_k": st.integers(-1, VOCAB + 2),
    "repetition_penalty": st.one_of(st.floats(0, 3), tiny_floats, st.just(Raw("1e308"))),
    "presence_penalty": st.one_of(st.floats(-2, 2), tiny_floats),
    "frequency_penalty": st.one_of(st.floats(-2, 2), tiny_floats),
    "logprobs": st.one_of(st.integers(0, 21), st.booleans()), "top_logprobs": st.integers(0, 21),
    "prompt_logprobs": st.integers(-1, 21), "seed": st.integers(0, 2**64),
    "stop": st.one_of(words, st.lists(words, max_size=5), st.just([""]), st.just("a" * 300)),
    "logit_bias": logit_bias, "response_format": response_formats,
    "guided_json": st.one_of(schema(), schema().map(dump)), "guided_regex": regexes,
    "guided_grammar": grammars, "guided_choice": choices, "tools": tools,
    "tool_choice": tool_choices, "chat_template_kwargs": template_kwargs,
    "speculative": speculative, "metadata": st.dictionaries(st.text(max_size=5),
                                                            st.text(max_size=5), max_size=2),
    "stream_options": st.fixed_dictionaries({}, optional={"include_usage": st.booleans()}),
    "tokens": st.lists(token_ids, max_size=12),
}
# Values each field accepts (or nearly: the combinations still meet the checks), for the
# requests that must get past validation to reach the scheduler and the model.
CLEAN = {
    "model": st.just(MODEL), "prompt": st.one_of(words, st.lists(words, min_size=1, max_size=3),
                                                 st.lists(st.integers(0, VOCAB - 1), min_size=1,
                                                          max_size=12)),
    "messages": st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system",
                                                                         "assistant"]),
                                                "content": words}), min_size=0, max_size=3)
    .map(lambda ms: ms + [{"role": "user", "content": "a b"}]),
    "max_tokens": st.integers(0, 8), "max_completion_tokens": st.integers(0, 8),
    "n": st.integers(1, 3), "temperature": st.one_of(st.just(0), st.floats(0, 2)),
    "top_p": st.floats(0.01, 1), "min_p": st.floats(0, 0.5), "top_k": st.integers(0, VOCAB),
    "repetition_penalty": st.floats(0.5, 2), "presence_penalty": st.floats(-2, 2),
    "frequency_penalty": st.floats(-2, 2), "logprobs": st.one_of(st.booleans(),
                                                                 st.integers(0, 5)),
    "top_logprobs": st.integers(0, 5), "prompt_logprobs": st.integers(0, 5),
    "seed": st.integers(0, 2**32), "stop": st.lists(words, min_size=1, max_size=4),
    "logit_bias": st.dictionaries(st.integers(0, VOCAB - 1).map(str), st.floats(-100, 100),
                                  max_size=4),
    "response_format": st.sampled_from([{"type": "text"}, {"type": "json_object"}, {
        "type": "json_schema", "json_schema": {"name": "x", "schema": {
            "type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}}}]),
    "guided_json": st.just({"type": "object", "properties": {"b": {"type": "boolean"}}}),
    "guided_regex": st.sampled_from(["[ab]+", "a{3}", "(a|b)*c"]),
    "guided_grammar": st.just('start: "a" | "b"'),
    "guided_choice": st.lists(words, min_size=1, max_size=5),
    "tools": st.just([{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "string"}}}}}]),
    "tool_choice": st.sampled_from(["none", "auto", "required"]),
    "chat_template_kwargs": st.just({"enable_thinking": False}),
    "speculative": st.fixed_dictionaries({"method": st.sampled_from(
        ["none", "vanilla", "ngram", "suffix", "hybrid"]), "num_draft_tokens": st.integers(1, 4)}),
    "stream_options": st.just({"include_usage": True}),
    "metadata": st.just({"k": "v"}), "tokens": st.lists(st.integers(0, VOCAB - 1), max_size=12),
}
# max_tokens is almost always sent: the default (the rest of the context) is slow to fuzz
ALWAYS = {"max_tokens"}
ONE_OF = ("prompt", "messages")  # /tokenize takes one of them, both optional
BY_TYPE = {int: st.integers(-3, 10), float: st.floats(-2, 3), bool: st.booleans(),
           str: st.text(max_size=12), NoneType: st.none()}
CLEAN_TYPE = {int: st.integers(0, 4), float: st.floats(0, 1), bool: st.booleans(),
              str: st.sampled_from(["x", "tiny"]), NoneType: st.none()}


def annotated(annotation, types=BY_TYPE) -> st.SearchStrategy:
    """A strategy from a field's annotation: each member of a union, hostile for Any."""
    if get_origin(annotation) in (Union, UnionType):
        return st.one_of(*(annotated(a, types) for a in get_args(annotation)))
    if annotation in types:
        return types[annotation]
    if isinstance(annotation, type) and hasattr(annotation, "model_fields"):
        return body(annotation)
    return hostile


def field_value(name: str, field, clean: bool) -> st.SearchStrategy:
    """clean: a value the field accepts; else mostly an edge value, sometimes a hostile one."""
    if clean:
        return CLEAN.get(name, annotated(field.annotation, CLEAN_TYPE))
    edge = BY_NAME.get(name, annotated(field.annotation))
    return st.one_of(edge, edge, edge, edge, edge, edge, hostile)


def body(model) -> st.SearchStrategy:
    """A JSON object for `model`: a third clean (values each field accepts), a third clean
    but for one or two fields (an edge or hostile value: what reaches the code past the
    first check), a third mixed with edge and hostile values throughout."""
    return st.one_of(fields_of(model, clean=True), one_off(model),
                     fields_of(model, clean=False))


SAMPLING = {"temperature", "top_p", "min_p", "top_k", "repetition_penalty", "presence_penalty",
            "frequency_penalty", "logit_bias", "seed"}


def one_off(model) -> st.SearchStrategy:
    """A clean body with one or two fields (any of the model's) set to an edge value."""
    edge = {n: field_value(n, f, clean=False) for n, f in model.model_fields.items()}

    # the sampling controls twice as often: their edge values reach the model step
    names = sorted(edge) + [n for n in sorted(edge) if n in SAMPLING]

    @st.composite
    def build(draw):
        out = draw(fields_of(model, clean=True))
        for name in draw(st.sets(st.sampled_from(names), min_size=1, max_size=2)):
            out[name] = draw(edge[name])
        return out

    return build()


def fields_of(model, clean: bool) -> st.SearchStrategy:
    fields = model.model_fields
    usual = {n: field_value(n, f, clean) for n, f in fields.items()
             if n in ALWAYS or f.is_required()}
    either = [n for n in ONE_OF if n in fields and n not in usual]
    rest = {n: field_value(n, f, clean) for n, f in fields.items() if n not in usual}

    @st.composite
    def build(draw):
        out = {}
        for name, value in usual.items():
            if clean or draw(st.integers(0, 19)):  # 1 in 20 leaves it out
                out[name] = draw(value)
        wanted = draw(st.sets(st.sampled_from(sorted(rest)), max_size=4 if clean else 6)) \
            if rest else set()
        if either and draw(st.integers(0, 9)):  # 1 in 10 as drawn: both, or neither
            wanted = (wanted - set(either)) | {draw(st.sampled_from(either))}
        if clean and "speculative" in rest and draw(st.booleans()):
            wanted.add("speculative")  # half of the clean requests speculate
        for name in sorted(wanted):
            out[name] = draw(rest[name])
        if not clean and not draw(st.integers(0, 30)):
            out[draw(st.sampled_from(["unknown", "__proto__", "max_tokens "]))] = 1
        return out

    return build()


def post(path: str, model) -> st.SearchStrategy:
    """POST calls to `path`: a body for `model`, now and then broken at the byte level."""
    objects = body(model).map(lambda b: dump(b).encode("utf-8", "surrogatepass"))
    broken = st.one_of(
        objects.map(lambda b: b[: len(b) // 2]),  # cut short
        objects.map(lambda b: b + b"\xff"), st.just(b""), st.just(b"null"), st.just(b"[]"),
        st.just(b'"x"'), st.just(b"1e400"), st.just(b"{" * 3000), st.binary(max_size=40))
    return st.one_of(*[objects] * 12, broken).map(lambda b: Call("POST", path, b))


GETS = ["/health", "/metrics", "/v1/models", "/tokenizer_info", "/", "/v1/models/",
        "/health?x=1", "/v1/completions", "/nope", "/v1/../health", "/%ff", "/openapi.json",
        "/docs", "/redoc", "//health", "/v1/chat/completions/"]
ROUTES = {
    "completions": post("/v1/completions", CompletionRequest),
    "chat": post("/v1/chat/completions", ChatRequest),
    "tokenize": post("/tokenize", TokenizeRequest),
    "detokenize": post("/detokenize", DetokenizeRequest),
    "get": st.one_of(st.sampled_from(GETS), st.text(alphabet="/abcdefhilmortv1_.%?=", max_size=20)
                     .map(lambda p: "/" + p)).map(lambda p: Call("GET", p)),
}
# The most work one request may ask for: every logprob, prompt logprobs, echo, n choices of
# several prompts filling the context (what made /health wait 10.9 s on SmolLM2).
heavy = st.fixed_dictionaries({
    "model": st.just(MODEL), "max_tokens": st.integers(1, 64), "echo": st.booleans(),
    "prompt": st.integers(1, 8).flatmap(lambda k: st.just([" ".join(["w7 a"] * 60)] * k)),
    "logprobs": st.sampled_from([5, 20]), "prompt_logprobs": st.sampled_from([None, 20]),
    "n": st.integers(1, 4), "stream": st.booleans(), "ignore_eos": st.just(True)}).map(
    lambda b: {k: v for k, v in b.items() if v is not None and not (
        k == "prompt_logprobs" and b["stream"])})
FLOATS = {"temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty",
          "frequency_penalty"}
# A clean generation request that speculates, with one or two sampling controls at their
# edge (subnormal, tiny, huge): a non-finite distribution in one row of a speculative step.
sampling = st.tuples(
    st.sampled_from([("/v1/completions", CompletionRequest), ("/v1/chat/completions",
                                                              ChatRequest)]),
    st.sampled_from(["none", "vanilla", "ngram", "suffix", "hybrid", "auto"]),
    st.sets(st.sampled_from(sorted(FLOATS) * 3 + sorted(SAMPLING)), min_size=1, max_size=2),
    st.booleans())


@st.composite
def edge_sampling(draw):
    (path, model), method, names, stream = draw(sampling)
    out = draw(fields_of(model, clean=True))
    out.update({name: draw(st.one_of(tiny_floats, tiny_floats, BY_NAME[name]) if name in FLOATS
                           else BY_NAME[name]) for name in names},
               speculative={"method": method}, stream=stream)
    return Call("POST", path, dump(out).encode("utf-8", "surrogatepass"))


ROUTES["sampling"] = edge_sampling()
# The logprob options together (echo, logprobs, prompt_logprobs, n, stream) on text and
# token-id prompts, ids outside the vocabulary among them.
ROUTES["logprobs"] = st.fixed_dictionaries({
    "model": st.just(MODEL), "max_tokens": st.integers(0, 4),
    "prompt": st.one_of(words, st.lists(token_ids, min_size=1, max_size=6),
                        st.lists(st.lists(token_ids, min_size=1, max_size=4), min_size=1,
                                 max_size=2))}, optional={
    "echo": st.booleans(), "logprobs": st.one_of(st.integers(-1, 21), st.booleans()),
    "prompt_logprobs": st.integers(-1, 21), "n": st.integers(1, 3), "stream": st.booleans(),
    "stream_options": st.just({"include_usage": True})}).map(
    lambda b: Call("POST", "/v1/completions", dump(b).encode()))
ROUTES["heavy"] = heavy.map(lambda b: Call("POST", "/v1/completions",
                                           dump(b).encode()))
# completions and chat generate, the rest are cheap: their share of a mixed run
# (in this order: the sampling edge first, on a fresh server, where a non-finite row is
# known to fail the step; after some traffic the same requests may pass)
WEIGHTS = {"sampling": 10, "logprobs": 10, "completions": 40, "chat": 40, "tokenize": 10,
           "detokenize": 10, "get": 10, "heavy": 1}  # a heavy request takes seconds: 1 in 131


def verdict(status: int, text: str) -> str | None:
    """What is wrong with a response, or None: a 5xx, an error event in a stream that blames
    the server, an error body not in OpenAI's shape."""
    if status >= 500:
        try:
            return f"status {status}: {json.loads(text)['error']['message'][:200]}"
        except (ValueError, KeyError, TypeError):
            return f"status {status}: {text[:200]}"
    for line in text.splitlines():
        if line.startswith("data: {") and '"error"' in line:
            try:
                error = json.loads(line[6:]).get("error") or {}
            except ValueError:
                return "an unreadable error event"
            if error.get("type") == "server_error" or "internal" in str(error.get("code")):
                return f"error event: {error.get('message')}"
    if 400 <= status < 500:
        try:
            error = json.loads(text)["error"]
            assert isinstance(error["message"], str) and "type" in error
        except (ValueError, KeyError, TypeError, AssertionError):
            return f"status {status} without OpenAI's error JSON"
    return None


def is_stream(call: Call) -> bool:
    return call.body is not None and b'"stream": true' in call.body


def victim_body(stream: bool = False) -> dict:
    """The greedy request whose output must not change across a fuzzing run; the stream
    beside the run speculates with the vanilla draft (a method whose step a non-finite
    distribution in another row can fail), the other does not."""
    return {"model": MODEL, "prompt": "a b c w7", "max_tokens": 16, "temperature": 0,
            "ignore_eos": True, "stream": stream,
            "speculative": {"method": "vanilla" if stream else "none"}}


