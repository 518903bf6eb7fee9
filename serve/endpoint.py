"""What both generation endpoints (completions.py, chat.py) do with a request:

    read_body     the body, within --max-body-bytes (413 past it); read_request parses it
                  too (a large one on a worker thread)
    check_model   the model is the one served (404)
    check_size    a prompt whose bytes alone cannot fit the context is refused untokenized
    check_response_size   an answer that could hold more than MAX_RESPONSE_VALUES
                  log-probability values is refused (400)
    answer        each of the request's prompts checked once and its n choices' Streams
                  built (Scheduler.prepare, off the event loop when it compiles a grammar),
                  all queued together (429 when the queue has no room for all), then
                  answered whole or as server-sent events (streaming.py); choices by index,
                  prompt-major (prompt i's j-th of n is i * n + j)
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
import uuid
from dataclasses import dataclass

from fastapi import Request
from pydantic import BaseModel
from starlette.requests import ClientDisconnect

from trt_spec.runtime.methods import DEFAULT, Speculation
from trt_spec.runtime.sampling import SamplingParams
from trt_spec.runtime.scheduler import QueueFull, Scheduler
from trt_spec.runtime.scheduler import Request as Job
from trt_spec.runtime.validation import STRUCTURES, FieldError
from trt_spec.serve.metrics import ServerMetrics
from trt_spec.serve.request_body import parse_body
from trt_spec.serve.request_log import note
from trt_spec.serve.protocol import (IGNORED, RequestError, ignored_fields,
                                     structure_param)
from trt_spec.serve.streaming import (Choice, EventStream, Outputs, Shape, TokenSources, cancel,
                                      collect, events)

log = logging.getLogger("trt_spec.server")
# the status of a request whose client left before it was read (nginx's "client closed
# request"): a 4xx, as the cause is the client's, never a server error; nobody reads it
CLIENT_CLOSED = 499
RETRY_AFTER_S = 1  # a 429's Retry-After: a slot frees within a few steps
# The most log-probability values (a token's logprob or one of its alternatives) one
# response may hold: each takes 20-70 bytes of JSON, so this is 20-70 MB. The largest request
# an evaluation harness sends passes it: lm-evaluation-harness's loglikelihood requests
# (echo, logprobs 1, max_tokens 0 or 1) of 128 prompts of 4,096 tokens (2 values a token).
# Estimated before anything is queued (response_values): past it, a 400 that says why.
MAX_RESPONSE_VALUES = 1 << 20
# a structure (response_format) that takes longer to compile is refused (its thread finishes
# on its own; llguidance's parser limits bound it too)
COMPILE_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class Served:
    """What the routes read (app.state.served): set once, by create_app."""

    scheduler: Scheduler
    model_name: str
    metrics: ServerMetrics
    max_body_bytes: int
    reasoning_in_content: bool = False  # a thinking section stays in content (no split)


def served(request: Request) -> Served:
    return request.app.state.served


async def read_body(request: Request) -> bytes:
    """The body, refused with 413 as soon as it is known to pass max_body_bytes."""
    limit = served(request).max_body_bytes
    too_large = RequestError(f"the request body is larger than {limit} bytes "
                             "(--max-body-bytes)", status=413, code="request_too_large")
    length = request.headers.get("content-length", "")
    if length.isdigit() and int(length) > limit:
        raise too_large
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise too_large
            chunks.append(chunk)
    except ClientDisconnect:  # the client left mid-body: no one to answer, nothing wrong here
        raise RequestError("the client disconnected before the request body was read",
                           status=CLIENT_CLOSED, code="client_disconnected") from None
    return b"".join(chunks)


# a body past this is parsed and checked on a worker thread (a 1 MiB one takes ~0.1 s)
PARSE_INLINE_BYTES = 64 * 1024


async def read_request(request: Request, model: type[BaseModel]) -> BaseModel:
    """The body read (read_body) and parsed into `model` (request_body.parse_body), a large
    body on a worker thread: the event loop is not held while it is walked."""
    raw = await read_body(request)
    if len(raw) <= PARSE_INLINE_BYTES:
        req = parse_body(raw, model)
    else:
        req = await asyncio.to_thread(parse_body, raw, model)
    if isinstance(getattr(req, "model", None), str):  # the access line's (request_log.py)
        note(model=req.model)
    return req


def check_model(name: str, served_name: str) -> None:
    if name != served_name:
        raise RequestError(f"model {name!r} does not exist; this server serves "
                           f"{served_name!r} (GET /v1/models)", "model", status=404,
                           code="model_not_found")


def check_size(scheduler: Scheduler, texts: list[str], param: str) -> None:
    """A prompt whose bytes alone need more tokens than the context holds is refused before
    it is tokenized (each token stands for at most max_token_bytes bytes)."""
    tokenizer = scheduler.tokenizer
    if tokenizer.normalizes:
        return
    size = sum(len(t.encode("utf-8")) for t in texts)
    least = size // tokenizer.max_token_bytes
    if least >= scheduler.max_len:
        raise RequestError(f"the prompt has at least {least} tokens ({size} bytes, at most "
                           f"{tokenizer.max_token_bytes} bytes per token); the context "
                           f"holds {scheduler.max_len} (prompt + output)", param)


@dataclass(frozen=True)
class Prompted:
    """One prompt to answer: its token ids, its sampling params (params.n choices), how its
    choices look (`shape`, copied per choice: Shape.for_index)."""

    ids: list[int]
    params: SamplingParams
    shape: Shape


async def answer(request: Request, req, prompts: list[Prompted]):
    """The request (a CompletionRequest or ChatRequest) answered: each of its prompts checked
    once and queued as a request of its own, n choices each (all of them, or a 429), then
    the choices answered together, whole or as server-sent events (stream: true)."""
    ctx = served(request)
    rid, choices, outputs = await queued(ctx, req, prompts)
    created = int(time.time())
    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return EventStream(events(rid, choices, outputs, ctx.model_name, created,
                                  include_usage, structure_param(req)),
                           lambda: cancel(ctx.scheduler, [c.job for c in choices]))
    return await collect(request, ctx.scheduler, rid, choices, outputs, ctx.model_name,
                         created, structure_param(req))


async def queued(ctx: Served, req,
                 prompts: list[Prompted]) -> tuple[str, list[Choice], Outputs]:
    """The request's prompts checked and queued, all or none (a 429): (the request's id, its
    choices, the Outputs they feed). POST /v1/responses (serve/responses.py) answers them in
    its own events."""
    if req.stream_options is not None and not req.stream:
        raise RequestError("stream_options is only allowed with stream: true",
                           "stream_options")
    note_ignored(req)
    check_response_size(req, prompts)
    outputs = Outputs()
    rid = f"{prompts[0].shape.id_prefix}-{uuid.uuid4().hex[:24]}"
    jobs, choices = [], []  # a Request per prompt (its choice 0); every choice
    for i, p in enumerate(prompts):
        if req.token_sources:  # each choice gets its own (Shape.for_index)
            p.shape.sources = TokenSources(p.shape.tokenizer)
        job_id = rid if len(prompts) == 1 else f"{rid}-{i}"
        name = p.shape.prompt_param if len(prompts) == 1 else f"{p.shape.prompt_param}[{i}]"
        job = await prepare(ctx.scheduler, req, p.ids, p.params, outputs.put, job_id, name)
        jobs.append(job)
        # the prompt's n choices (SamplingParams.n), indexed prompt-major
        choices += [Choice(c, p.shape.for_index(len(choices) + c.index)) for c in job.choices]
    try:
        ctx.scheduler.enqueue_all(jobs)  # with every choice of each
    except QueueFull as e:
        raise RequestError(f"the server is busy: {e}", status=429, code="queue_full",
                           headers={"Retry-After": str(RETRY_AFTER_S)}) from None
    note(jobs=[c.job for c in choices])  # the access line's numbers, at its end
    return rid, choices, outputs


def response_values(prompts: list[Prompted], stream: bool) -> tuple[int, int]:
    """(prompt, output) log-probability values the answer would hold at most: per prompt,
    its tokens x (alternatives + 1) in each place that shows them (Shape.prompt_copies),
    and unless streamed (each chunk holds only its tokens') max_tokens x (logprobs + 1) x
    n."""
    prompt = output = 0
    for p in prompts:
        params = p.params
        if params.prompt_logprobs is not None:
            prompt += len(p.ids) * (params.prompt_logprobs + 1) * p.shape.prompt_copies(params)
        if params.logprobs is not None and not stream:
            output += params.max_tokens * (params.logprobs + 1) * params.n
    return prompt, output


def check_response_size(req, prompts: list[Prompted]) -> None:
    """RequestError (400) where the answer could hold more than MAX_RESPONSE_VALUES
    log-probability values, naming the field that asks for the larger part."""
    prompt, output = response_values(prompts, bool(req.stream))
    if prompt + output <= MAX_RESPONSE_VALUES:
        return
    logprobs = "top_logprobs" if hasattr(req, "top_logprobs") else "logprobs"
    param = logprobs if output >= prompt or req.prompt_logprobs is None else "prompt_logprobs"
    raise RequestError(
        f"this answer could hold {prompt + output:,} log-probability values ({prompt:,} for "
        f"the prompts: tokens x (alternatives + 1) x n per prompt; {output:,} for the "
        f"output: max_tokens x ({logprobs} + 1) x n per prompt, unless streamed); at most "
        f"{MAX_RESPONSE_VALUES:,} are answered: ask for fewer alternatives, a smaller n or "
        "max_tokens, or send fewer prompts per request", param, code="response_too_large")


async def prepare(scheduler: Scheduler, req, ids: list[int], params: SamplingParams,
                  on_output, request_id: str, prompt_name: str) -> Job:
    """Scheduler.prepare, the one check of a request: a grammar compiles (or comes from the
    cache) on a worker thread, within COMPILE_TIMEOUT_S. RequestError naming the request's
    field (a prompt's problem quotes which prompt: prompt[i] of several)."""
    asked = req.speculative
    spec = Speculation(asked.method, asked.num_draft_tokens) if asked else DEFAULT
    make = functools.partial(scheduler.prepare, ids, params, spec, on_output, request_id)
    try:
        if params.structure is None:
            return make()
        return await asyncio.wait_for(asyncio.to_thread(make), COMPILE_TIMEOUT_S)
    except FieldError as e:
        param = request_param(e.field, req, prompt_name.split("[")[0])
        message = str(e) if "[" not in prompt_name or e.field != "prompt" else \
            f"{prompt_name}: {e}"
        raise RequestError(message, param) from None
    except asyncio.TimeoutError:
        param = structure_param(req)
        raise RequestError(f"{param} took more than {COMPILE_TIMEOUT_S:g} s to compile; "
                           "simplify it", param) from None


_noted: set[str] = set()  # IGNORED fields already logged by this process


def note_ignored(req) -> None:
    """Logs the IGNORED fields a request sets: the first time each is seen, as a warning."""
    for name in ignored_fields(req):
        if name not in _noted:
            _noted.add(name)
            log.warning("request field %r is accepted and ignored: %s (logged once)", name,
                        IGNORED[name])


def request_param(field: str, req, prompt_param: str) -> str:
    """The request's field (OpenAI's `param`) for a field Scheduler.prepare names."""
    if field == "prompt":
        return prompt_param
    if field in STRUCTURES:
        return structure_param(req)
    return field  # speculative, max_tokens
