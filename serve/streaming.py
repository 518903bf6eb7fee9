"""A request's answer, from the scheduler's Outputs: server-sent events, or one response.

    scheduler thread   on_output(out) -> loop.call_soon_threadsafe(queue.put_nowait, out)
    event loop         events():  a chunk per delta, each naming its choice's index (n > 1:
                                  the choices' chunks interleave as they come, as OpenAI's);
                                  the last carries this server's metrics, then usage
                                  (stream_options.include_usage) and [DONE]
                       collect(): waits for every choice's last Output, then answers in one
                                  body

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

    def opening(self, index: int) -> dict | None:
        """Choice `index` streamed before any token (chat: the role), or None."""
        return None

    def delta(self, index: int, text: str, logprobs: list[TokenLogprob],
              finish_reason: str | None) -> dict:
        """A streamed chunk's choice `index`: the new text and its tokens' logprobs."""
        raise NotImplementedError

    def whole(self, index: int, text: str, logprobs: list[TokenLogprob],
              finish_reason: str) -> dict:
        """A whole response's choice `index`."""
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


def usage(choices: list[RequestMetrics]) -> dict:
    """OpenAI's usage over a request's choices: the prompt once, the completions' tokens
    summed; cached_tokens: the first choice's prompt tokens whose KV came from the prefix
    cache (the others start from its rows)."""
    m = choices[0]
    completion = sum(c.completion_tokens for c in choices)
    return {"prompt_tokens": m.prompt_tokens, "completion_tokens": completion,
            "total_tokens": m.prompt_tokens + completion,
            "prompt_tokens_details": {"cached_tokens": m.cached_tokens}}


def choice_metrics(job: Job) -> list[RequestMetrics]:
    return [c.stream.metrics() for c in job.choices]


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
    """The server-sent events of a streamed answer: per choice a chunk per delta, its last
    with the finish reason; the request's last chunk carries the metrics (of choice 0); with
    include_usage (as OpenAI) a chunk of empty choices and usage; then [DONE]. An abort or
    error ends with an error event and [DONE]."""
    head = {"id": job.id, "object": shape.chunk_object, "created": created, "model": model}
    for c in job.choices:
        if (choice := shape.opening(c.index)) is not None:
            yield sse({**head, "choices": [choice]})
    left = len(job.choices)
    while left:
        out = await outputs.get()
        if out.finish_reason in ("abort", "error"):
            yield sse({"error": {"message": out.request.error or SHUTDOWN,
                                 "type": "server_error", "param": None,
                                 "code": out.finish_reason}})
            yield DONE
            return
        left -= out.finished
        if not (out.finished or out.text or out.logprobs):
            continue
        chunk = {**head, "choices": [shape.delta(out.request.index, out.text, out.logprobs,
                                                 out.finish_reason)]}
        if not left:
            chunk["metrics"] = response_metrics(job.stream.metrics())
        yield sse(chunk)
    if include_usage:
        yield sse({**head, "choices": [], "usage": usage(choice_metrics(job))})
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
    """Frees the request's slots (every choice's) at the next step, unless it has finished."""
    if not all(c.done for c in job.choices):
        scheduler.cancel(job.id)


async def collect(request: Request, scheduler: Scheduler, job: Job, outputs: Outputs,
                  shape: Shape, model: str, created: int) -> dict:
    """The whole answer, once every choice's last Output is in; a client that disconnects
    first cancels the request. An error is a 500, an abort (shutdown) a 503."""
    async def watch_disconnect():
        while (await request.receive())["type"] != "http.disconnect":
            pass
        scheduler.cancel(job.id)

    watcher = asyncio.create_task(watch_disconnect())
    left = len(job.choices)
    try:
        while left:
            out = await outputs.get()
            left -= out.finished
            if out.finish_reason in ("error", "abort"):
                break
    finally:
        watcher.cancel()
        cancel(scheduler, job)
    if out.finish_reason == "error":
        raise RequestError(f"generation failed: {out.request.error}", status=500, code="error")
    if out.finish_reason == "abort":
        raise RequestError("the request was cancelled", status=503, code="abort")
    choices = [shape.whole(c.index, c.stream.text, c.stream.logprobs, c.stream.finish_reason)
               for c in job.choices]
    return {"id": job.id, "object": shape.object, "created": created, "model": model,
            "choices": choices, "usage": usage(choice_metrics(job)),
            "metrics": response_metrics(job.stream.metrics())}
