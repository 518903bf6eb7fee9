"""A request's answer, from the scheduler's Outputs: server-sent events, or one response.

    scheduler thread   on_output(out) -> loop.call_soon_threadsafe(queue.put_nowait, out)
    event loop         events():  a chunk per delta, each naming its choice's index (the
                                  choices' chunks interleave as they come, as OpenAI's);
                                  each choice's last carries this server's metrics and
                                  the request's seed, then
                                  usage (stream_options.include_usage) and [DONE]
                       collect(): waits for every choice's last Output, then answers in one
                                  body, built and serialized on a worker thread (with
                                  logprobs it may hold a million values: endpoint.py
                                  MAX_RESPONSE_VALUES); a chunk that carries the prompt's
                                  logprobs is built on one too

An answer has one choice per queued scheduler Request: n per prompt (SamplingParams.n, the
prompt read once), and a completions request with several prompts has n for each, indexed
prompt-major (prompt i's j-th is i * n + j). All feed one Outputs queue; each choice has its
own Shape (its index, its state across chunks).

What a choice looks like is the endpoint's own (a Shape: chat.py, completions.py); what every
answer carries besides (usage, metrics, the error event of an aborted stream) is here.
"""

from __future__ import annotations

import asyncio
import codecs
import copy
import functools
import json
from dataclasses import dataclass

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from trt_spec.runtime.grammar import LIMIT
from trt_spec.runtime.provenance import TokenSource
from trt_spec.runtime.sampling import TokenLogprob
from trt_spec.runtime.scheduler import Output, Scheduler
from trt_spec.runtime.scheduler import Request as Job
from trt_spec.runtime.stream import RequestMetrics
from trt_spec.runtime.tokenizer import Tokenizer
from trt_spec.serve.protocol import RequestError

DONE = "data: [DONE]\n\n"
SHUTDOWN = ("the request was cancelled: the server is shutting down and --shutdown-timeout "
            "has passed")


class Shape:
    """How one endpoint's choices look: their object names and their content. One per
    choice: it carries the choice's index, and completions' logprobs count text offsets
    across its chunks."""

    object: str  # a whole response's "object"
    chunk_object: str  # a streamed chunk's
    id_prefix: str  # of the request's id
    prompt_param: str  # the request field holding the prompt (what a 400 about it names)

    def __init__(self, tokenizer: Tokenizer, logprobs: bool, index: int = 0):
        """logprobs: the request asked for them (SamplingParams.logprobs is not None);
        index: the choice's (prompt-major: prompt i's j-th of n is i * n + j)."""
        self.tokenizer = tokenizer
        self.with_logprobs = logprobs
        self.index = index
        self.sources: TokenSources | None = None  # the request asked for token_sources

    def for_index(self, index: int) -> "Shape":
        """This shape for another choice of the same prompt (n > 1): a copy, made before any
        output, with that choice's index (and its own token_sources' text state)."""
        other = copy.copy(self)
        other.index = index
        if self.sources is not None:
            other.sources = TokenSources(self.tokenizer)
        return other

    def opening(self) -> dict | None:
        """The choice streamed before any token (chat: the role), or None."""
        return None

    def wants_chunk(self, out: Output) -> bool:
        """Whether a delta that does not finish the choice is worth a chunk."""
        return bool(out.text or out.logprobs)

    def delta(self, job: Job, out: Output) -> dict:
        """A streamed chunk's choice: the new text and its tokens' logprobs."""
        raise NotImplementedError

    def whole(self, job: Job) -> dict:
        """A whole response's choice, from its finished stream."""
        raise NotImplementedError

    def response_fields(self, job: Job) -> dict:
        """Fields of a whole response besides choices (chat: prompt_logprobs)."""
        return {}

    def prompt_copies(self, params) -> int:
        """How many times the answer shows the prompt's logprobs (params.prompt_logprobs set):
        once, beside the choices."""
        return 1

    def bulky(self) -> bool:
        """The next streamed delta carries the prompt's logprobs (built on a worker
        thread)."""
        return False


class TokenSources:
    """One choice's `token_sources` (the extension a request opts into): per token its id,
    text, bytes and origin (runtime/provenance.py). The texts join to the choice's text: a
    token that splits a UTF-8 character carries the characters its bytes complete ("" for
    the first part of the character, which the token completing it carries); a special
    token (<|im_end|>), which the text skips, carries "" (its bytes still spell it). Where a
    stop string ends the text, the tokens still hold what the stop string cut."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self.decoder = codecs.getincrementaldecoder("utf-8")("replace")

    def entries(self, token_ids: list[int], sources: list[TokenSource],
                final: bool = False) -> list[dict]:
        """The entries of a delta's tokens."""
        out, special = [], self.tokenizer.special_ids
        for j, (t, src) in enumerate(zip(token_ids, sources)):
            raw = self.tokenizer.token_bytes(t)
            last = final and j == len(token_ids) - 1
            text = self.decoder.decode(b"" if t in special else raw, last)
            out.append({**src.as_json(t, text), "bytes": list(raw)})
        return out

    def add(self, choice: dict, token_ids: list[int], sources, final: bool = False) -> dict:
        """`choice` with its tokens' entries under "token_sources"."""
        return {**choice, "token_sources": self.entries(token_ids, sources, final)}


@dataclass(frozen=True)
class Choice:
    """One choice of an answer: the queued request that makes it and how it looks."""

    job: Job
    shape: Shape


def token_piece(tokenizer: Tokenizer, token_id: int) -> tuple[str, list[int]]:
    """A token's text (invalid UTF-8 replaced) and its bytes, as OpenAI's logprobs show it."""
    raw = tokenizer.token_bytes(token_id)
    return raw.decode("utf-8", errors="replace"), list(raw)


def prompt_logprobs(tokenizer: Tokenizer, logprobs: list[TokenLogprob | None]) -> list:
    """vLLM's prompt_logprobs: per prompt token None (the first) or {token id: {logprob,
    rank, decoded_token}} for the token itself and its most likely alternatives."""
    def entry(token_id: int, logprob: float, rank: int) -> tuple[str, dict]:
        return str(token_id), {"logprob": logprob, "rank": rank,
                               "decoded_token": token_piece(tokenizer, token_id)[0]}

    return [None if lp is None else dict(
        [entry(lp.token_id, lp.logprob, lp.rank)]
        + [entry(t, v, r) for r, (t, v) in enumerate(lp.top, 1) if t != lp.token_id])
        for lp in logprobs]


class Outputs:
    """A request's Outputs, handed from the scheduler thread to the event loop (made on it)."""

    def __init__(self):
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue[Output] = asyncio.Queue()

    def put(self, out: Output) -> None:  # the request's on_output, on the scheduler thread
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, out)
        except RuntimeError:  # the event loop has closed (shutdown)
            pass

    async def get(self) -> Output:
        return await self.queue.get()


def usage(jobs: list[Job]) -> dict:
    """OpenAI's usage over an answer's choices: each prompt once (its choice 0's: the others
    start from its rows), the completions' tokens summed; cached_tokens: prompt tokens whose
    KV came from the prefix cache."""
    ms = [j.stream.metrics() for j in jobs]
    firsts = [m for j, m in zip(jobs, ms) if j.index == 0]
    prompt, completion = sum(m.prompt_tokens for m in firsts), \
        sum(m.completion_tokens for m in ms)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": sum(m.cached_tokens for m in firsts)}}


def request_seed(job: Job) -> int:
    """The `seed` extension: the seed the request was sampled with (its own, or the one the
    server drew for it); sent again with it, the request gets the same answer, under any
    method and k (choice i draws with seed + i)."""
    return job.choices[0].stream.params.seed if job.choices else job.stream.params.seed


def answer_metrics(ms: list[RequestMetrics]) -> dict | list[dict]:
    """The `metrics` extension of an answer: one choice's, or a list in choice order."""
    return response_metrics(ms[0]) if len(ms) == 1 else [response_metrics(m) for m in ms]


def response_metrics(m: RequestMetrics) -> dict:
    """This server's extension to an answer: the request's method, k, tau and acceptance."""
    return {"method": m.method, "num_draft_tokens": m.num_draft_tokens,
            "cached_tokens": m.cached_tokens, "tau": m.tau,
            "proposed_tokens": m.proposed_tokens, "accepted_tokens": m.accepted_tokens,
            "acceptance_per_position": list(m.acceptance_per_position),
            "time_to_first_token_s": m.time_to_first_token_s,
            "decode_tokens_per_s": m.decode_tokens_per_s, "drafted_by": dict(m.drafted_by),
            "executor": m.executor, "executor_fallback": m.fallback}


@dataclass(frozen=True)
class Failure:
    """Why a choice ended with abort or error, as the client is told: a whole response's
    status, or a stream's error event."""

    message: str
    status: int
    code: str
    param: str | None = None

    def body(self) -> dict:
        return RequestError(self.message, self.param, self.status, self.code).body()


def failure(job: Job, structure: str | None) -> Failure:
    """Why a choice ended with abort or error. A structure the output could not go on with
    (runtime/grammar.py Guide.failure: a text no token spells, or the grammar engine's
    limits) is the request's fault, a 400 naming `structure` (the field that asked for
    it); an engine error a 500; the shutdown a 503."""
    s = job.stream
    if job.error:
        return Failure(f"generation failed: {job.error}", 500, "error")
    guide = s.guide
    if s.finish_reason == "error" and guide is not None and guide.failure is not None:
        code = "structure_limit" if guide.failure.startswith(LIMIT) else "structure_dead_end"
        return Failure(f"{structure}: the output was held to it, and after "
                       f"{len(s.output_ids)} tokens ({s.text[-60:]!r}) {guide.failure}; "
                       "simplify the structure or give the vocabulary a way through it",
                       400, code, structure)
    if s.finish_reason == "error":
        return Failure("generation failed: the output could not go on", 500, "error")
    return Failure(SHUTDOWN, 503, "abort")


def whole(c: Choice) -> dict:
    """A whole response's choice, with its token_sources where the request asked for them."""
    choice = c.shape.whole(c.job)
    s = c.job.stream
    return c.shape.sources.add(choice, s.output_ids, s.sources, final=True) \
        if c.shape.sources else choice


PIECE = 512  # list items serialized per call (json's C encoder holds the GIL for a call)


def dumps(obj, separators=(",", ":")) -> str:
    """JSON as the responses write it (compact, UTF-8, as Starlette's JSONResponse), made in
    pieces: a long list PIECE items per call of the C encoder, which holds the GIL for the
    whole call (one call for a 50 MB body would stall the event loop for half a second;
    a piece takes a few milliseconds). Same text as json.dumps."""
    out: list[str] = []
    encode = json.JSONEncoder(ensure_ascii=False, separators=separators).encode
    item, key = separators

    def walk(v):
        if isinstance(v, dict):
            out.append("{")
            for j, (k, x) in enumerate(v.items()):
                out.append((item if j else "") + encode(str(k)) + key)
                walk(x)
            out.append("}")
        elif isinstance(v, list) and len(v) > PIECE:
            out.append("[")
            for i in range(0, len(v), PIECE):
                out.append((item if i else "") + encode(v[i:i + PIECE])[1:-1])
            out.append("]")
        elif isinstance(v, list):
            out.append("[")
            for i, x in enumerate(v):
                if i:
                    out.append(item)
                walk(x)
            out.append("]")
        else:
            out.append(encode(v))

    walk(obj)
    return "".join(out)


def sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


async def events(rid: str, choices: list[Choice], outputs: Outputs, model: str, created: int,
                 include_usage: bool, structure: str | None = None):
    """The server-sent events of a streamed answer: a chunk per delta of any choice, each
    choice's last with its finish reason and metrics; with include_usage (as OpenAI) a chunk
    of empty choices and usage; then [DONE]. An abort or error ends with an error event
    (`failure`; structure: the request field holding its structure) and [DONE] (the other
    choices are cancelled as the response closes)."""
    head = {"id": rid, "object": choices[0].shape.chunk_object, "created": created,
            "model": model}
    by_job = {c.job: c for c in choices}  # the n choices of a prompt share its id
    for c in choices:
        if (opening := c.shape.opening()) is not None:
            yield sse({**head, "choices": [opening]})
    left = len(choices)
    while left:
        out = await outputs.get()
        c = by_job[out.request]
        traced = c.shape.sources
        if not out.finished:
            if c.shape.wants_chunk(out) or (traced and out.token_ids):
                yield await chunk(head, c, out)
            continue
        left -= 1
        if out.finish_reason in ("abort", "error"):
            yield sse(failure(c.job, structure).body())
            yield DONE
            return
        yield await chunk(head, c, out, {"metrics": response_metrics(c.job.stream.metrics()),
                                         "seed": request_seed(c.job)})
    if include_usage:
        yield sse({**head, "choices": [], "usage": usage([c.job for c in choices])})
    yield DONE


async def chunk(head: dict, c: Choice, out: Output, more: dict | None = None) -> str:
    """The event of one choice's delta; on a worker thread where it carries the prompt's
    logprobs (Shape.bulky: up to a million values), else here (a few tokens' worth)."""
    def build(bulky: bool) -> str:
        choice = c.shape.delta(c.job, out)
        if c.shape.sources:
            choice = c.shape.sources.add(choice, out.token_ids, out.sources, out.finished)
        event = {**head, "choices": [choice], **(more or {})}
        return f"data: {dumps(event, (', ', ': '))}\n\n" if bulky else sse(event)

    return await asyncio.to_thread(build, True) if c.shape.bulky() else build(False)


class EventStream(StreamingResponse):
    """Server-sent events; `on_close` runs however the response ends: finished, failed, or
    cancelled because the client went away (even before the first event)."""

    def __init__(self, events, on_close):
        super().__init__(events, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache"})
        self.on_close = on_close

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()


def cancel(scheduler: Scheduler, jobs: list[Job]) -> None:
    """Frees the slots of the requests that have not finished, at the next step (by id: every
    choice of a prompt)."""
    for job in jobs:
        if not job.done:
            scheduler.cancel(job.id)


async def collect(request: Request, scheduler: Scheduler, rid: str, choices: list[Choice],
                  outputs: Outputs, model: str, created: int,
                  structure: str | None = None) -> Response:
    """The whole answer, once every choice's last Output is in, as JSON built on a worker
    thread; a client that disconnects first cancels its requests. A failed choice answers
    for all (`failure`: the structure's fault a 400 naming `structure`, an engine error a
    500, an abort (shutdown) a 503)."""
    jobs = [c.job for c in choices]
    await finished(request, scheduler, jobs, outputs, structure)
    build = functools.partial(whole_body, rid, choices, model, created)
    body = await asyncio.to_thread(build) if bulky(jobs) else build()
    return Response(body, media_type="application/json")


async def finished(request: Request, scheduler: Scheduler, jobs: list[Job], outputs: Outputs,
                   structure: str | None = None) -> None:
    """Returns once every job's last Output is in (collect's wait; POST /v1/responses's too);
    a client that disconnects first cancels them. RequestError where one failed (`failure`)
    or was aborted (503)."""

    async def watch_disconnect():
        while (await request.receive())["type"] != "http.disconnect":
            pass
        cancel(scheduler, jobs)

    watcher = asyncio.create_task(watch_disconnect())
    left = len(jobs)
    try:
        while left:
            left -= (await outputs.get()).finished
    finally:
        watcher.cancel()
        cancel(scheduler, jobs)
    reasons = [j.stream.finish_reason for j in jobs]
    if "error" in reasons:
        f = failure(jobs[reasons.index("error")], structure)
        raise RequestError(f.message, f.param, f.status, f.code)
    if "abort" in reasons:
        raise RequestError("the request was cancelled", status=503, code="abort")


BULKY_VALUES = 4096  # an answer with more tokens and logprobs is built on a worker thread


def bulky(jobs: list[Job]) -> bool:
    """The answer holds more than BULKY_VALUES tokens and log-probability values (a small
    one is built here: a worker thread would cost more than it saves)."""
    values = 0
    for j in jobs:
        s, p = j.stream, j.stream.params
        values += len(s.output_ids) * (1 if p.logprobs is None else p.logprobs + 2)
        if p.prompt_logprobs is not None:
            values += len(s.prompt_ids) * (p.prompt_logprobs + 2)
    return values > BULKY_VALUES


def whole_body(rid: str, choices: list[Choice], model: str, created: int) -> bytes:
    """A whole answer's JSON, from its finished choices."""
    jobs = [c.job for c in choices]
    ms = [j.stream.metrics() for j in jobs]
    shape = choices[0].shape
    return dumps({"id": rid, "object": shape.object, "created": created, "model": model,
                  "choices": [whole(c) for c in choices], "usage": usage(jobs),
                  "metrics": answer_metrics(ms), "seed": request_seed(jobs[0]),
                  **shape.response_fields(choices[0].job)}
                 ).encode("utf-8")
