"""A request's answer, from the scheduler's Outputs: server-sent events, or one response.

    scheduler thread   on_output(out) -> loop.call_soon_threadsafe(queue.put_nowait, out)
    event loop         events():  a chunk per delta; the last carries this server's metrics,
                                  then usage (stream_options.include_usage) and [DONE]
                       collect(): waits for the last Output, then answers in one body

What a choice looks like is the endpoint's own (a Shape: chat.py, completions.py); what every
answer carries besides (usage, metrics, the error event of an aborted stream) is here.
"""

from __future__ import annotations

import asyncio
import json

from fastapi import Request
from fastapi.responses import StreamingResponse

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
    """How one endpoint's answers look: their object names and their choices. One per
    request: completions' logprobs count text offsets across its chunks."""

    object: str  # a whole response's "object"
    chunk_object: str  # a streamed chunk's
    id_prefix: str  # of the request's id
    prompt_param: str  # the request field holding the prompt (what a 400 about it names)

    def __init__(self, tokenizer: Tokenizer, logprobs: bool):
        """logprobs: the request asked for them (SamplingParams.logprobs is not None)."""
        self.tokenizer = tokenizer
        self.with_logprobs = logprobs

    def opening(self) -> dict | None:
        """The choice streamed before any token (chat: the role), or None."""
        return None

    def delta(self, text: str, logprobs: list[TokenLogprob], finish_reason: str | None) -> dict:
        """A streamed chunk's choice: the new text and its tokens' logprobs."""
        raise NotImplementedError

    def whole(self, text: str, logprobs: list[TokenLogprob], finish_reason: str) -> dict:
        """A whole response's choice."""
        raise NotImplementedError


def token_piece(tokenizer: Tokenizer, token_id: int) -> tuple[str, list[int]]:
    """A token's text (invalid UTF-8 replaced) and its bytes, as OpenAI's logprobs show it."""
    raw = tokenizer.token_bytes(token_id)
    return raw.decode("utf-8", errors="replace"), list(raw)


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


def usage(m: RequestMetrics) -> dict:
    """OpenAI's usage; cached_tokens: prompt tokens whose KV came from the prefix cache."""
    return {"prompt_tokens": m.prompt_tokens, "completion_tokens": m.completion_tokens,
            "total_tokens": m.prompt_tokens + m.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": m.cached_tokens}}


def response_metrics(m: RequestMetrics) -> dict:
    """This server's extension to an answer: the request's method, k, tau and acceptance."""
    return {"method": m.method, "num_draft_tokens": m.num_draft_tokens,
            "cached_tokens": m.cached_tokens, "tau": m.tau,
            "proposed_tokens": m.proposed_tokens, "accepted_tokens": m.accepted_tokens,
            "acceptance_per_position": list(m.acceptance_per_position),
            "time_to_first_token_s": m.time_to_first_token_s,
            "decode_tokens_per_s": m.decode_tokens_per_s, "drafted_by": dict(m.drafted_by)}


def sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


async def events(job: Job, outputs: Outputs, shape: Shape, model: str, created: int,
                 include_usage: bool):
    """The server-sent events of a streamed answer: a chunk per delta, the last with the
    finish reason and metrics; with include_usage (as OpenAI) a chunk of empty choices and
    usage; then [DONE]. An abort or error ends with an error event and [DONE]."""
    head = {"id": job.id, "object": shape.chunk_object, "created": created, "model": model}
    if (choice := shape.opening()) is not None:
        yield sse({**head, "choices": [choice]})
    while not (out := await outputs.get()).finished:
        if out.text or out.logprobs:
            yield sse({**head, "choices": [shape.delta(out.text, out.logprobs, None)]})
    if out.finish_reason in ("abort", "error"):
        yield sse({"error": {"message": job.error or SHUTDOWN, "type": "server_error",
                             "param": None, "code": out.finish_reason}})
        yield DONE
        return
    m = job.stream.metrics()
    yield sse({**head, "choices": [shape.delta(out.text, out.logprobs, out.finish_reason)],
               "metrics": response_metrics(m)})
    if include_usage:
        yield sse({**head, "choices": [], "usage": usage(m)})
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


def cancel(scheduler: Scheduler, job: Job) -> None:
    """Frees the request's slot at the next step, unless it has finished."""
    if not job.done:
        scheduler.cancel(job.id)


async def collect(request: Request, scheduler: Scheduler, job: Job, outputs: Outputs,
                  shape: Shape, model: str, created: int) -> dict:
    """The whole answer, once the last Output is in; a client that disconnects first cancels
    the request. An error is a 500, an abort (shutdown) a 503."""
    async def watch_disconnect():
        while (await request.receive())["type"] != "http.disconnect":
            pass
        scheduler.cancel(job.id)

    watcher = asyncio.create_task(watch_disconnect())
    try:
        while not (out := await outputs.get()).finished:
            pass
    finally:
        watcher.cancel()
        cancel(scheduler, job)
    if out.finish_reason == "error":
        raise RequestError(f"generation failed: {job.error}", status=500, code="error")
    if out.finish_reason == "abort":
        raise RequestError("the request was cancelled", status=503, code="abort")
    s = job.stream
    m = s.metrics()
    return {"id": job.id, "object": shape.object, "created": created, "model": model,
            "choices": [shape.whole(s.text, s.logprobs, s.finish_reason)], "usage": usage(m),
            "metrics": response_metrics(m)}
