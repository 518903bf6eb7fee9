"""OpenAI request bodies: the fields this server reads, and every check on them.

Whatever a request gets wrong raises RequestError quoting the bad value and saying what is
allowed; the server answers it as OpenAI does: status 4xx and
{"error": {"message", "type", "param", "code"}}.
"""

from __future__ import annotations

import json
import secrets
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict

from trt_spec.runtime import validation
from trt_spec.runtime.sampling import MAX_LOGPROBS, SamplingParams
from trt_spec.runtime.tokenizer import Tokenizer

MAX_STOP = 4  # stop strings per request, as OpenAI
# prompts in one /v1/completions request (a list of strings or of token-id lists; each is
# one choice, queued as a request of its own): evaluation harnesses batch 16-64; the waiting
# queue's bound (--max-waiting) caps it too
MAX_PROMPTS = 128
MAX_STOP_CHARS = 256
MAX_BAD_WORDS = 1024
MAX_DEPTH = validation.MAX_DEPTH  # JSON nesting: a request needs 4
# every integer in a body is an int64, as the fields that hold them are (seed: a uint64)
INT64 = (-2**63, 2**63 - 1)
STRICT = ConfigDict(extra="forbid", strict=True)  # no coercion: "max_tokens": true is a 400


class RequestError(Exception):
    def __init__(self, message: str, param: str | None = None, status: int = 400,
                 code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.message, self.param, self.status, self.code = message, param, status, code
        self.headers = headers

    def body(self) -> dict:
        kind = ("rate_limit_exceeded" if self.status == 429 else
                "invalid_request_error" if self.status < 500 else "server_error")
        return {"error": {"message": self.message, "type": kind, "param": self.param,
                          "code": self.code}}


class Speculative(BaseModel):
    """The extension field: {"speculative": {"method": "ngram", "num_draft_tokens": 4}}."""

    model_config = STRICT
    method: str | None = None
    num_draft_tokens: int | str | None = None  # k, or "auto" / "auto:K" (adaptive, at most K)


class StreamOptions(BaseModel):
    model_config = STRICT
    # as OpenAI: true adds a last chunk with empty choices carrying usage
    include_usage: bool | None = None


class _Request(BaseModel):
    model_config = STRICT
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
    # token id (a decimal string, as JSON keys are) -> bias in -100..100; checked by
    # SamplingParams (runtime/validation.py) and against the vocabulary (Scheduler.prepare)
    logit_bias: Any = None
    # accepted and ignored (IGNORED says why; the server logs the first of each)
    user: str | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    # vLLM's: per prompt token, its log-probability and the n most likely alternatives
    prompt_logprobs: int | None = None
    # extensions (vLLM's names)
    top_k: int | None = None  # default 0 (off; -1 too, vLLM's old default)
    min_p: float | None = None  # default 0 (off)
    repetition_penalty: float | None = None  # default 1 (off)
    ignore_eos: bool | None = None
    speculative: Speculative | None = None
    # this server's: each token's origin (an accepted draft and its drafter, the grammar, or
    # the target) in choices[].token_sources, streamed per chunk (serve/streaming.py)
    token_sources: bool | None = None
    # OpenAI's structured outputs: {"type": "text" | "json_object" | "json_schema", ...};
    # checked by hand (response_format below), on completions too
    response_format: Any = None
    # vLLM's names for the other structures (SamplingParams checks them), one per request
    guided_json: Any = None  # a JSON schema (an object or its JSON text)
    guided_regex: Any = None
    guided_grammar: Any = None  # llguidance's Lark dialect
    guided_choice: Any = None  # a list of strings
    # vLLM's newer form of them: {"json" | "regex" | "grammar" | "choice" | "json_object"}
    structured_outputs: Any = None
    # more of vLLM's sampling fields (SamplingParams checks them; runtime/sampling.py)
    min_tokens: int | None = None  # default 0
    stop_token_ids: Any = None  # a list of token ids that end the output
    allowed_token_ids: Any = None  # a list of token ids: the output holds only these
    bad_words: Any = None  # a list of strings (tokenized here: bad_words_ids)
    skip_special_tokens: bool | None = None  # default true
    include_stop_str_in_output: bool | None = None  # default false
    # the prompt's token ids cut to their last (truncation_side "right": first) n; -1: the
    # context's length less one
    truncate_prompt_tokens: int | None = None
    truncation_side: str | None = None  # "left" (default) | "right"
    # vLLM's fields accepted and ignored (IGNORED says why) or refused (REFUSED: a 400)
    spaces_between_special_tokens: Any = None
    use_beam_search: Any = None
    length_penalty: Any = None
    watermarking: Any = None
    logprob_token_ids: Any = None
    priority: Any = None
    request_id: Any = None
    session_id: Any = None
    return_tokens_as_token_ids: Any = None
    return_token_ids: Any = None
    return_token_offsets: Any = None
    return_prompt_text: Any = None
    return_mm_kwargs: Any = None
    routed_experts_prompt_start: Any = None
    cache_salt: Any = None
    kv_transfer_params: Any = None
    ec_transfer_params: Any = None
    vllm_xargs: Any = None
    repetition_detection: Any = None
    stream_interval: Any = None
    thinking_token_budget: Any = None
    guided_decoding_backend: Any = None
    guided_whitespace_pattern: Any = None
    logits_processors: Any = None
    add_special_tokens: bool | None = None  # C: default true (a BOS where the model has
    # one); Ch: ignored (the chat template writes the special tokens)
    # the IGNORED fields this route acts on after all
    implemented: ClassVar[frozenset[str]] = frozenset()


# Fields OpenAI's and vLLM's clients send that change nothing here, and why
# (docs/serving.md's table)
IGNORED = {
    "user": "no per-user accounting: log it in front of the server",
    "metadata": "nothing is stored to tag",
    "store": "nothing is stored",
    "service_tier": "one tier: every request is served alike",
    "prompt_cache_key": "the prefix cache matches prompts by their tokens, unasked",
    "safety_identifier": "no abuse monitoring here",
    "spaces_between_special_tokens": "the tokenizer's decoder joins special tokens as it "
                                     "does (a fast tokenizer's own rule)",
    "length_penalty": "no beam search",
    "watermarking": "no watermarking",
    "logprob_token_ids": "logprobs report the most likely tokens (logprobs, top_logprobs)",
    "priority": "requests are served first come, first served",
    "request_id": "the response's id is the server's own",
    "session_id": "no per-session state",
    "return_tokens_as_token_ids": "logprobs show each token's text and bytes",
    "return_token_ids": "token_sources (an extension) lists each token's id",
    "return_token_offsets": "no render endpoint",
    "return_prompt_text": "/tokenize shows the templated prompt",
    "return_mm_kwargs": "a text-only server",
    "routed_experts_prompt_start": "no expert routing data",
    "cache_salt": "the prefix cache is not salted: every request shares it",
    "kv_transfer_params": "no disaggregated serving",
    "ec_transfer_params": "no disaggregated serving",
    "vllm_xargs": "no custom extensions",
    "repetition_detection": "no repetition detector: max_tokens bounds the output",
    "stream_interval": "each step's tokens stream as they come",
    "thinking_token_budget": "the thinking section has no budget of its own",
    "guided_decoding_backend": "one grammar engine (llguidance)",
    "guided_whitespace_pattern": "the grammar engine's own whitespace rule",
    "logits_processors": "no custom logits processors",
    "add_special_tokens": "the chat template writes the special tokens",
    "media_io_kwargs": "a text-only server",
    "mm_processor_kwargs": "a text-only server",
}

# Fields defined by OpenAI or vLLM that this server cannot act on: a 400 saying why, when
# set to anything but their default (REFUSED_DEFAULT)
REFUSED = {
    "use_beam_search": "no beam search: sample n choices instead",
    "chat_template": "a request cannot bring its own chat template; start the server with "
                     "--chat-template FILE",
    "prompt_embeds": "prompts are text or token ids",
}
REFUSED_DEFAULT = {"use_beam_search": False}


class CompletionRequest(_Request):
    prompt: Any  # str | [str] | [int] | [[int]]: one choice per prompt (completion_prompts)
    logprobs: int | bool | None = None  # alternatives per token, 0..20; false / null: none
    echo: bool | None = None  # the prompt (with logprobs: its tokens' too) before the text
    prompt_embeds: Any = None  # refused
    implemented: ClassVar[frozenset[str]] = frozenset({"add_special_tokens"})


class ChatRequest(_Request):
    messages: Any  # checked by runtime/validation.py's chat(), as the Python API's
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None  # 0..20, with logprobs: true
    # tool calling (runtime/tool_calls.py checks them)
    tools: Any = None
    tool_choice: Any = None  # none | auto | required | {"type": "function", ...}
    parallel_tool_calls: bool | None = None  # default true
    # more of the chat template's variables, e.g. {"enable_thinking": false} (vLLM's name;
    # runtime/reasoning.py's template_kwargs checks it)
    chat_template_kwargs: Any = None
    # vLLM's: how the chat is rendered (runtime/chat.py rendering)
    add_generation_prompt: bool | None = None  # default true
    continue_final_message: bool | None = None  # default false: the last message left open
    echo: bool | None = None  # the last message, when the assistant's, in front of the answer
    documents: Any = None  # the template's `documents` (RAG templates)
    # OpenAI's: "none" turns the template's thinking off (enable_thinking false), any other
    # on; the template also reads it as `reasoning_effort`
    reasoning_effort: str | None = None
    include_reasoning: bool | None = None  # default true: false leaves reasoning_content out
    chat_template: Any = None  # refused
    media_io_kwargs: Any = None
    mm_processor_kwargs: Any = None


def chat_messages(req: ChatRequest) -> list[dict]:
    try:
        return validation.chat(req.messages)
    except validation.FieldError as e:
        raise RequestError(str(e), e.field) from None


PROMPT_FORMS = ("a string, a list of strings, a list of token ids, or a list of token-id "
                "lists")


def completion_prompts(req: CompletionRequest) -> list[str | list[int]]:
    """The request's prompts, each as text or token ids: a string or a list of token ids is
    one prompt; a list of strings or of token-id lists, one each (at most MAX_PROMPTS)."""
    p = req.prompt
    if isinstance(p, str) or (isinstance(p, list) and p and all(map(is_token, p))):
        prompts = [p]
    elif isinstance(p, list) and p and all(isinstance(x, (str, list)) for x in p):
        prompts = p
    else:
        raise RequestError(f"prompt={json.dumps(p)[:80]}: expected {PROMPT_FORMS}", "prompt")
    if len(prompts) > MAX_PROMPTS:
        raise RequestError(f"prompt holds {len(prompts)} prompts; at most {MAX_PROMPTS} are "
                           "allowed per request", "prompt")
    for i, x in enumerate(prompts):
        name = "prompt" if len(prompts) == 1 else f"prompt[{i}]"
        if not x:
            raise RequestError(f"{name} is empty: at least one token is needed", "prompt")
        if isinstance(x, list) and not all(map(is_token, x)):
            bad = next(t for t in x if not is_token(t))
            raise RequestError(f"{name} holds {json.dumps(bad)[:40]}: a token-id list holds "
                               f"integers only (prompt: {PROMPT_FORMS})", "prompt")
    return prompts


def is_token(t) -> bool:
    return isinstance(t, int) and not isinstance(t, bool)


def ignored_fields(req: _Request) -> list[str]:
    """The IGNORED fields the request sets (those its route does not act on)."""
    return [name for name in IGNORED if getattr(req, name, None) is not None
            and name not in req.implemented]


def check_refused(req: _Request) -> None:
    """RequestError for a REFUSED field the request sets to other than its default."""
    for name, why in REFUSED.items():
        value = getattr(req, name, None)
        if value is not None and value != REFUSED_DEFAULT.get(name):
            raise RequestError(f"{name}={json.dumps(value)[:80]}: not available here ({why})",
                               name)


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


def logprobs_asked(req: _Request) -> int | None:
    """Alternatives per token wanted (0..20), or None: no logprobs."""
    if isinstance(req, ChatRequest):
        if req.top_logprobs is not None and not req.logprobs:
            raise RequestError(f"top_logprobs={req.top_logprobs}: needs logprobs: true",
                               "top_logprobs")
        if not req.logprobs:
            return None
        return 0 if req.top_logprobs is None else req.top_logprobs
    if req.logprobs is True:
        raise RequestError("logprobs=true: on /v1/completions logprobs is the number of "
                           f"alternatives per token, 0..{MAX_LOGPROBS}", "logprobs")
    return None if req.logprobs is False else req.logprobs


def prompt_logprobs_asked(req: _Request) -> int | None:
    """Alternatives per prompt token wanted (0..20), or None: vLLM's prompt_logprobs, or on
    completions echo with logprobs (the echoed tokens' logprobs); the larger of both."""
    asked = [req.prompt_logprobs]
    if isinstance(req, CompletionRequest) and req.echo and req.logprobs not in (None, False):
        asked.append(req.logprobs)
    asked = [n for n in asked if n is not None]
    if req.stream and req.prompt_logprobs is not None:
        raise RequestError("prompt_logprobs is not available with stream: true (as vLLM); "
                           "on /v1/completions echo with logprobs streams them", "prompt_logprobs")
    return max(asked) if asked else None


def sampling_params(req: _Request, max_tokens: int | None, default_max_tokens: int,
                    tokenizer: Tokenizer | None = None) -> SamplingParams:
    """The request's SamplingParams: the server's own limits here (OpenAI's stop limits),
    every other check in SamplingParams (runtime/validation.py), shared with the Python API,
    and in Scheduler.prepare (n against --max-num-seqs, token ids against the vocabulary);
    each error names the field and the allowed values. null takes each default; a request
    without a seed gets one here, for all its prompts, which its answer reports (`seed`).
    tokenizer: what bad_words are tokenized with (a request with bad_words needs it)."""
    field = "top_logprobs" if isinstance(req, ChatRequest) else "logprobs"
    given = {name: getattr(req, name) for name in CONTROLS if getattr(req, name) is not None}
    check_refused(req)
    try:
        return SamplingParams(
            max_tokens=default_max_tokens if max_tokens is None else max_tokens,
            temperature=1.0 if req.temperature is None else req.temperature,
            top_k=0 if req.top_k in (None, -1) else req.top_k,
            top_p=1.0 if req.top_p is None else req.top_p,
            seed=secrets.randbits(64) if req.seed is None else req.seed,
            stop=stop_strings(req.stop), ignore_eos=bool(req.ignore_eos),
            logprobs=logprobs_asked(req), prompt_logprobs=prompt_logprobs_asked(req),
            n=1 if req.n is None else req.n, **given,
            bad_words_ids=bad_words_ids(req.bad_words, tokenizer),
            skip_special_tokens=req.skip_special_tokens is not False,
            include_stop_str_in_output=bool(req.include_stop_str_in_output),
            **structure(req))
    except validation.FieldError as e:
        param = (field if e.field == "logprobs" else
                 structure_param(req) if e.field in validation.STRUCTURES else e.field)
        message = str(e).replace("logprobs=", f"{param}=", 1) if e.field == "logprobs" else str(e)
        raise RequestError(message, param) from None


# the sampling controls, by the same names in a request and in SamplingParams (null: the
# default)
CONTROLS = ("logit_bias", "presence_penalty", "frequency_penalty", "repetition_penalty", "min_p",
            "min_tokens", "stop_token_ids", "allowed_token_ids")
GUIDED = {"guided_json": "json_schema", "guided_regex": "regex",
          "guided_grammar": "grammar", "guided_choice": "choice"}
# vLLM's structured_outputs keys -> SamplingParams' structure fields (json_object: true, any
# JSON object); its options, which the grammar engine has no switch for, are accepted
STRUCTURED_OUTPUTS = {"json": "json_schema", "regex": "regex", "grammar": "grammar",
                      "choice": "choice", "json_object": "json_schema"}
STRUCTURED_OPTIONS = ("backend", "disable_fallback", "disable_any_whitespace",
                      "disable_additional_properties", "whitespace_pattern")


def bad_words_ids(words, tokenizer: Tokenizer | None) -> tuple[tuple[int, ...], ...]:
    """vLLM's bad_words -> the token-id sequences the output may not hold: each word's
    tokens, and where they differ, those of the word after a space (the word in the middle
    of a text: a byte-level BPE gives it other tokens)."""
    if words is None:
        return ()
    if not isinstance(words, list) or not all(isinstance(w, str) and w.strip() for w in words) \
            or len(words) > MAX_BAD_WORDS:
        raise RequestError(f"bad_words={json.dumps(words)[:80]}: expected a list of at most "
                           f"{MAX_BAD_WORDS} non-blank strings", "bad_words")
    assert tokenizer is not None, "bad_words need the tokenizer"
    out = []
    for word in words:
        for text in (word.lstrip(), " " + word.lstrip()):
            ids = tuple(tokenizer.encode(text, add_special_tokens=False))
            if ids and ids not in out:
                out.append(ids)
    return tuple(out)


def truncated(ids: list[int], req: _Request, context: int) -> list[int]:
    """vLLM's truncate_prompt_tokens: the prompt's last n token ids (truncation_side "right":
    its first n); -1: as many as the context holds with one token to spare; null: all."""
    n, side = req.truncate_prompt_tokens, req.truncation_side or "left"
    if side not in ("left", "right"):
        raise RequestError(f"truncation_side={side!r}: must be \"left\" (keep the last tokens) "
                           "or \"right\" (keep the first)", "truncation_side")
    if n is None:
        return ids
    if n == -1:
        n = context - 1
    if n < 1:
        raise RequestError(f"truncate_prompt_tokens={n}: must be -1 (the context's length) "
                           "or at least 1", "truncate_prompt_tokens")
    return ids[-n:] if side == "left" else ids[:n]


def structure(req: _Request) -> dict:
    """SamplingParams' structure fields from response_format, vLLM's guided_* fields or its
    structured_outputs; two structures in one request are a 400."""
    given = {name: getattr(req, name) for name in GUIDED if getattr(req, name) is not None}
    schema = response_format(req.response_format)
    if schema is not None:
        given["response_format"] = schema
    named = {GUIDED.get(name, "json_schema"): value for name, value in given.items()}
    for key, value in structured_outputs(req.structured_outputs).items():
        given[f"structured_outputs.{key}"] = value
        named[STRUCTURED_OUTPUTS[key]] = {"type": "object"} if key == "json_object" else value
    if len(given) > 1:
        raise RequestError(f"{' and '.join(given)} are given; a request holds its output to "
                           "one structure", list(given)[1].split(".")[0])
    return named


def structured_outputs(value) -> dict:
    """vLLM's structured_outputs -> {key: value} of its structure keys that are set (its
    options accepted and left to the grammar engine's defaults)."""
    if value is None:
        return {}
    allowed = (*STRUCTURED_OUTPUTS, *STRUCTURED_OPTIONS)
    if not isinstance(value, dict) or any(k not in allowed for k in value):
        raise RequestError(f"structured_outputs={json.dumps(value)[:80]}: expected an object "
                           f"of {', '.join(allowed)}", "structured_outputs")
    out = {k: v for k, v in value.items()
           if k in STRUCTURED_OUTPUTS and v is not None and v is not False}
    if out.get("json_object", True) is not True:
        raise RequestError("structured_outputs.json_object: must be true or false",
                           "structured_outputs")
    return out


def structure_param(req: _Request) -> str:
    """The request field that asked for the structure (what a 400 about it names): a guided_*
    field, response_format, or the tools whose call grammar holds the output."""
    named = next((name for name in GUIDED if getattr(req, name) is not None), None)
    if named is None and req.structured_outputs is not None:
        return "structured_outputs"
    if named is None and req.response_format is None and getattr(req, "tools", None):
        return "tools"
    return named or "response_format"


def response_format(value) -> dict | None:
    """OpenAI's response_format -> the JSON schema the output is held to, or None (text).
    {"type": "json_object"}: any JSON object; {"type": "json_schema", "json_schema": {"name",
    "schema", "strict", "description"}}: that schema."""
    if value is None:
        return None
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "object"}
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
            raise RequestError("response_format json_schema: expected {\"json_schema\": "
                               "{\"name\": ..., \"schema\": {...}}}", "response_format")
        return spec["schema"]
    raise RequestError(f"response_format={json.dumps(value)[:80]}: expected "
                       "{\"type\": \"text\" | \"json_object\" | \"json_schema\"}",
                       "response_format")
