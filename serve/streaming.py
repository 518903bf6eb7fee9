"""A request's answer, from the scheduler's Outputs: server-sent events, or one response.

    scheduler thread   on_output(out) -> loop.call_soon_threadsafe(queue.put_nowait, out)
    event loop         events():  a chunk per delta, each naming its choice's index (the
                                  choices' chunks interleave as they come, as OpenAI's);
                                  each choice's last carries this server's metrics, then
                                  usage (stream_options.include_usage) and [DONE]
                       collect(): waits for every choice's last Output, then answers in one
                                  body

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
import json
from dataclasses import dataclass

from fastapi import Request
from fastapi.responses import StreamingResponse

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
DEAD_END = ("the output reached a point where no token can continue the structure it is "
            "held to (its text so far is a prefix no token extends)")


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
            "decode_tokens_per_s": m.decode_tokens_per_s, "drafted_by": dict(m.drafted_by)}


def failure(job: Job) -> str:
    """Why a choice ended with abort or error."""
    if job.error:
        return job.error
    return DEAD_END if job.stream.finish_reason == "error" else SHUTDOWN


def whole(c: Choice) -> dict:
    """A whole response's choice, with its token_sources where the request asked for them."""
    choice = c.shape.whole(c.job)
    s = c.job.stream
    return c.shape.sources.add(choice, s.output_ids, s.sources, final=True) \
        if c.shape.sources else choice


def sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


async def events(rid: str, choices: list[Choice], outputs: Outputs, model: str, created: int,
                 include_usage: bool):
    """The server-sent events of a streamed answer: a chunk per delta of any choice, each
    choice's last with its finish reason and metrics; with include_usage (as OpenAI) a chunk
    of empty choices and usage; then [DONE]. An abort or error ends with an error event and
    [DONE] (the other choices are cancelled as the response closes)."""
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
                choice = c.shape.delta(c.job, out)
                if traced:
                    choice = traced.add(choice, out.token_ids, out.sources)
                yield sse({**head, "choices": [choice]})
            continue
        left -= 1
        if out.finish_reason in ("abort", "error"):
            yield sse({"error": {"message": failure(c.job), "type": "server_error",
                                 "param": None, "code": out.finish_reason}})
            yield DONE
            return
        choice = c.shape.delta(c.job, out)
        if traced:
            choice = traced.add(choice, out.token_ids, out.sources, final=True)
        yield sse({**head, "choices": [choice],
                   "metrics": response_metrics(c.job.stream.metrics())})
    if include_usage:
        yield sse({**head, "choices": [], "usage": usage([c.job for c in choices])})
    yield DONE


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
                  outputs: Outputs, model: str, created: int) -> dict:
    """The whole answer, once every choice's last Output is in; a client that disconnects
    first cancels its requests. An error is a 500, an abort (shutdown) a 503."""
    jobs = [c.job for c in choices]

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
        job = jobs[reasons.index("error")]
        raise RequestError(f"generation failed: {failure(job)}", status=500, code="error")
    if "abort" in reasons:
        raise RequestError("the request was cancelled", status=503, code="abort")
    ms = [j.stream.metrics() for j in jobs]
    shape = choices[0].shape
    return {"id": rid, "object": shape.object, "created": created, "model": model,
            "choices": [whole(c) for c in choices], "usage": usage(jobs),
            "metrics": answer_metrics(ms), **shape.response_fields(choices[0].job)}
