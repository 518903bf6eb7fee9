"""`trt-spec serve`: an OpenAI-compatible HTTP server on FastAPI + uvicorn.

    POST /v1/completions, /v1/chat/completions   (stream: true -> server-sent events)
    GET  /v1/models, /health, /metrics            (Prometheus text)

Every request goes to one Scheduler, whose loop runs in its own thread: the event loop only
parses, queues and forwards deltas (`on_output` -> `loop.call_soon_threadsafe` -> an
asyncio.Queue per request), so a model step never blocks it. A client that disconnects
cancels its request, which frees its KV slot at the next step. On SIGTERM uvicorn stops
accepting connections and waits (up to --shutdown-timeout) for in-flight responses to
finish; then the scheduler stops, ending whatever is left with "abort".
"""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from trt_spec.runtime.metrics import ServerMetrics
from trt_spec.runtime.protocol import (ChatRequest, CompletionRequest, RequestError,
                                       chat_messages, completion_prompt, parse_body,
                                       sampling_params)
from trt_spec.runtime.sampling import SamplingParams
from trt_spec.runtime.scheduler import Output, QueueFull, Scheduler
from trt_spec.runtime.scheduler import Request as Job

log = logging.getLogger("trt_spec.server")
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # as OpenAI's /v1/completions; chat: the rest of the context


@dataclass
class Kind:
    """What differs between the two endpoints' responses."""

    object: str  # "text_completion" | "chat.completion"
    chunk_object: str
    id_prefix: str
    chat: bool


COMPLETION = Kind("text_completion", "text_completion", "cmpl", chat=False)
CHAT = Kind("chat.completion", "chat.completion.chunk", "chatcmpl", chat=True)


def create_app(scheduler: Scheduler, model_name: str, start_loop: bool = True) -> FastAPI:
    metrics = ServerMetrics(scheduler, model_name)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        if start_loop:
            scheduler.start()
        yield
        scheduler.stop(timeout=30)

    app = FastAPI(title="trt-spec", lifespan=lifespan)
    app.state.scheduler, app.state.metrics = scheduler, metrics

    def error(e: RequestError) -> JSONResponse:
        if e.status < 500:
            metrics.rejected("queue_full" if e.status == 429 else "invalid")
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(RequestError)
    async def on_request_error(request: Request, e: RequestError):
        return error(e)

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: Request, e: StarletteHTTPException):
        routes = "POST /v1/completions, POST /v1/chat/completions, GET /v1/models, " \
                 "GET /health, GET /metrics"
        return error(RequestError(f"{request.method} {request.url.path}: {e.detail}; this "
                                  f"server has {routes}", status=e.status_code))

    @app.get("/health")
    async def health():
        if not scheduler.alive:
            return JSONResponse({"status": "stopped"}, status_code=503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{
            "id": model_name, "object": "model", "created": 0, "owned_by": "trt-spec",
            "max_model_len": scheduler.max_len, "methods": scheduler.methods}]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        req = parse_body(await request.body(), CompletionRequest)
        check_model(req.model, model_name)
        prompt = completion_prompt(req)
        ids = prompt if isinstance(prompt, list) else scheduler.gen.encode(prompt, chat=False)
        default = min(COMPLETIONS_DEFAULT_MAX_TOKENS, scheduler.max_len - len(ids))
        params = sampling_params(req, req.max_tokens, max(default, 1))
        return await run(request, req, ids, params, COMPLETION)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        req = parse_body(await request.body(), ChatRequest)
        check_model(req.model, model_name)
        messages = chat_messages(req)
        try:
            ids = scheduler.gen.encode(messages)
        except ValueError as e:  # no chat template, or the template refused the messages
            raise RequestError(str(e), "messages") from None
        max_tokens = req.max_completion_tokens if req.max_tokens is None else req.max_tokens
        params = sampling_params(req, max_tokens, max(scheduler.max_len - len(ids), 1))
        return await run(request, req, ids, params, CHAT)

    async def run(request: Request, req, ids: list[int], params: SamplingParams, kind: Kind):
        spec = req.speculative
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[Output] = asyncio.Queue()

        def on_output(out: Output) -> None:  # on the scheduler thread
            try:
                loop.call_soon_threadsafe(queue.put_nowait, out)
            except RuntimeError:  # the event loop has closed (shutdown)
                pass

        method, k = (spec.method, spec.num_draft_tokens) if spec else (None, None)
        try:
            scheduler.resolve(method, k)
        except ValueError as e:
            raise RequestError(str(e), "speculative") from None
        try:
            scheduler.check(ids, params)
        except ValueError as e:  # the prompt, or max_tokens, does not fit the context
            param = "max_tokens" if str(e).startswith("max_tokens") else \
                "messages" if kind.chat else "prompt"
            raise RequestError(str(e), param) from None
        try:
            job = scheduler.submit(ids, params, method, k, on_output,
                                   f"{kind.id_prefix}-{uuid.uuid4().hex[:24]}")
        except QueueFull as e:
            raise RequestError(f"the server is busy: {e}", status=429,
                               code="queue_full") from None
        created = int(time.time())
        if req.stream:
            return EventStream(sse(job, queue, kind, created), lambda: cancel(job))
        return await collect(request, job, queue, kind, created)

    def sse_event(obj) -> str:
        return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"

    async def sse(job: Job, queue: asyncio.Queue, kind: Kind, created: int):
        head = {"id": job.id, "object": kind.chunk_object, "created": created,
                "model": model_name}

        def chunk(text: str | None, finish_reason=None, role=False):
            if kind.chat:
                delta = {"role": "assistant", "content": ""} if role else \
                    ({"content": text} if text else {})
                choice = {"index": 0, "delta": delta, "logprobs": None,
                          "finish_reason": finish_reason}
            else:
                choice = {"index": 0, "text": text or "", "logprobs": None,
                          "finish_reason": finish_reason}
            return {**head, "choices": [choice]}

        if kind.chat:
            yield sse_event(chunk(None, role=True))
        while True:
            out: Output = await queue.get()
            if out.finish_reason in ("abort", "error"):
                message = job.error or "the request was cancelled (server shutting down)"
                yield sse_event({"error": {"message": message, "type": "server_error",
                                           "param": None, "code": out.finish_reason}})
                return
            if out.text and not out.finished:
                yield sse_event(chunk(out.text))
            if out.finished:
                yield sse_event({**chunk(out.text, out.finish_reason), **result_extras(job)})
                yield "data: [DONE]\n\n"
                return

    def cancel(job: Job) -> None:
        if not job.done:
            scheduler.cancel(job.id)

    async def collect(request: Request, job: Job, queue: asyncio.Queue, kind: Kind,
                      created: int):
        async def watch_disconnect():
            while (await request.receive())["type"] != "http.disconnect":
                pass
            scheduler.cancel(job.id)

        watcher = asyncio.create_task(watch_disconnect())
        try:
            while not (out := await queue.get()).finished:
                pass
        finally:
            watcher.cancel()
            cancel(job)
        if out.finish_reason == "error":
            raise RequestError(f"generation failed: {job.error}", status=500, code="error")
        if out.finish_reason == "abort":
            raise RequestError("the request was cancelled", status=503, code="abort")
        s = job.stream
        if kind.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": s.text},
                      "logprobs": None, "finish_reason": s.finish_reason}
        else:
            choice = {"index": 0, "text": s.text, "logprobs": None,
                      "finish_reason": s.finish_reason}
        return {"id": job.id, "object": kind.object, "created": created, "model": model_name,
                "choices": [choice], **result_extras(job)}

    return app


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


def check_model(name: str, served: str) -> None:
    if name != served:
        raise RequestError(f"model {name!r} does not exist; this server serves {served!r} "
                           "(GET /v1/models)", "model", status=404, code="model_not_found")


def result_extras(job: Job) -> dict:
    """usage (OpenAI) and metrics (this server's extension: method, k, tau, acceptance)."""
    s = job.stream
    m = s.metrics()
    usage = {"prompt_tokens": len(s.prompt_ids), "completion_tokens": len(s.output_ids),
             "total_tokens": len(s.prompt_ids) + len(s.output_ids)}
    keep = ("tau", "proposed_tokens", "accepted_tokens", "acceptance_per_position",
            "time_to_first_token_s", "decode_tokens_per_s")
    return {"usage": usage, "metrics": {"method": job.method, "num_draft_tokens":
                                        job.num_draft_tokens, **{k: m[k] for k in keep}}}


def serve(scheduler: Scheduler, model_name: str, host: str, port: int,
          shutdown_timeout: float) -> None:
    """Runs until SIGINT / SIGTERM (uvicorn's handlers: a graceful shutdown)."""
    import uvicorn

    app = create_app(scheduler, model_name)
    config = uvicorn.Config(app, host=host, port=port, log_level="warning",
                            timeout_graceful_shutdown=shutdown_timeout)
    # uvicorn handles the signal while it runs, then raises it again under the handlers it
    # found; these make that a no-op, so a graceful shutdown exits with status 0.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: None)
    uvicorn.Server(config).run()
