"""`trt-spec serve`: an OpenAI-compatible HTTP server on FastAPI + uvicorn.

    POST /v1/completions, /v1/chat/completions   (stream: true -> server-sent events)
    GET  /v1/models, /health, /metrics            (Prometheus text)

Every request goes to one Scheduler, whose loop runs in its own thread: the event loop only
parses, queues and forwards deltas (`on_output` -> `loop.call_soon_threadsafe` -> an
asyncio.Queue per request), so a model step never blocks it. A client that disconnects
cancels its request, which frees its KV slot at the next step. On SIGTERM uvicorn stops
accepting connections and waits (up to --shutdown-timeout) for in-flight responses to
finish; past it the scheduler stops, ending whatever is left with "abort": a stream gets a
last error event and [DONE], a full response a 503.

No single request can stall the others: the body is read up to --max-body-bytes (413 past
it), prompts are tokenized and chat templates rendered on worker threads (the tokenizer
releases the GIL), a prompt that cannot fit the context is refused from its size before
tokenizing, and a long prompt is prefilled in chunks (Scheduler.max_prefill_tokens).
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

from trt_spec.serve.metrics import ServerMetrics
from trt_spec.serve.options import ServeOptions
from trt_spec.serve.protocol import (ChatRequest, CompletionRequest, RequestError,
                                       chat_messages, completion_prompt, parse_body,
                                       sampling_params, structure_param)
from trt_spec.runtime.sampling import SamplingParams, TokenLogprob
from trt_spec.runtime.settings import DEFAULT_MAX_BODY_BYTES
from trt_spec.runtime.scheduler import Output, QueueFull, Scheduler
from trt_spec.runtime.scheduler import Request as Job

log = logging.getLogger("trt_spec.server")
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # as OpenAI's /v1/completions; chat: the rest of the context
RETRY_AFTER_S = 1  # a 429's Retry-After: a slot frees within a few steps


# a structure (response_format) that takes longer to compile is refused (its thread finishes
# on its own; llguidance's parser limits bound it too)
COMPILE_TIMEOUT_S = 10.0


@dataclass
class Kind:
    """What differs between the two endpoints' responses."""

    object: str  # "text_completion" | "chat.completion"
    chunk_object: str
    id_prefix: str
    chat: bool


COMPLETION = Kind("text_completion", "text_completion", "cmpl", chat=False)
CHAT = Kind("chat.completion", "chat.completion.chunk", "chatcmpl", chat=True)


def create_app(scheduler: Scheduler, model_name: str, start_loop: bool = True,
               max_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> FastAPI:
    if not isinstance(max_body_bytes, int) or max_body_bytes < 1:
        raise ValueError(f"max_body_bytes={max_body_bytes!r}: must be an integer >= 1")
    metrics = ServerMetrics(scheduler, model_name)
    tokenizer = scheduler.gen.tokenizer

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
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    @app.exception_handler(RequestError)
    async def on_request_error(request: Request, e: RequestError):
        return error(e)

    @app.exception_handler(Exception)
    async def on_bug(request: Request, e: Exception):
        # a bug, not the client's fault: still OpenAI's JSON, and counted
        log.error("%s %s: %s: %s", request.method, request.url.path, type(e).__name__, e)
        metrics.rejected("error")
        return JSONResponse(RequestError(f"internal error: {type(e).__name__}: {e}",
                                         status=500, code="internal_error").body(),
                            status_code=500)

    async def read_body(request: Request) -> bytes:
        """The body, refused with 413 as soon as it is known to pass max_body_bytes."""
        too_large = RequestError(f"the request body is larger than {max_body_bytes} bytes "
                                 "(--max-body-bytes)", status=413, code="request_too_large")
        length = request.headers.get("content-length", "")
        if length.isdigit() and int(length) > max_body_bytes:
            raise too_large
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > max_body_bytes:
                raise too_large
            chunks.append(chunk)
        return b"".join(chunks)

    def check_size(texts: list[str], param: str) -> None:
        """A prompt whose bytes alone need more tokens than the context holds is refused
        before it is tokenized (each token stands for at most max_token_bytes bytes)."""
        if tokenizer.normalizes:
            return
        size = sum(len(t.encode("utf-8")) for t in texts)
        least = size // tokenizer.max_token_bytes
        if least >= scheduler.max_len:
            raise RequestError(f"the prompt has at least {least} tokens ({size} bytes, at most "
                               f"{tokenizer.max_token_bytes} bytes per token); the context "
                               f"holds {scheduler.max_len} (prompt + output)", param)

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
        req = parse_body(await read_body(request), CompletionRequest)
        check_model(req.model, model_name)
        prompt = completion_prompt(req)
        if isinstance(prompt, list):
            ids = prompt
        else:
            check_size([prompt], "prompt")
            ids = await asyncio.to_thread(scheduler.gen.encode, prompt, False)
        default = min(COMPLETIONS_DEFAULT_MAX_TOKENS, scheduler.max_len - len(ids))
        params = sampling_params(req, req.max_tokens, max(default, 1))
        return await run(request, req, ids, params, COMPLETION)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        req = parse_body(await read_body(request), ChatRequest)
        check_model(req.model, model_name)
        messages = chat_messages(req)
        check_size([m["content"] for m in messages], "messages")
        try:  # the template and the tokenizer, off the event loop
            ids = await asyncio.to_thread(scheduler.gen.encode, messages)
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

        if req.stream_options is not None and not req.stream:
            raise RequestError("stream_options is only allowed with stream: true",
                               "stream_options")
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
        if params.structure is not None:  # compiled (and cached) off the event loop
            try:
                await asyncio.wait_for(asyncio.to_thread(scheduler.gen.grammars.guide, params),
                                       COMPILE_TIMEOUT_S)
            except ValueError as e:
                raise RequestError(str(e), structure_param(req)) from None
            except asyncio.TimeoutError:
                raise RequestError(f"{structure_param(req)} took more than "
                                   f"{COMPILE_TIMEOUT_S:g} s to compile; simplify it",
                                   structure_param(req)) from None
        try:
            job = scheduler.submit(ids, params, method, k, on_output,
                                   f"{kind.id_prefix}-{uuid.uuid4().hex[:24]}")
        except QueueFull as e:
            raise RequestError(f"the server is busy: {e}", status=429, code="queue_full",
                               headers={"Retry-After": str(RETRY_AFTER_S)}) from None
        created = int(time.time())
        if req.stream:
            usage = bool(req.stream_options and req.stream_options.include_usage)
            return EventStream(sse(job, queue, kind, created, usage), lambda: cancel(job))
        return await collect(request, job, queue, kind, created)

    def sse_event(obj) -> str:
        return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"

    async def sse(job: Job, queue: asyncio.Queue, kind: Kind, created: int,
                  include_usage: bool):
        head = {"id": job.id, "object": kind.chunk_object, "created": created,
                "model": model_name}
        offset = 0  # completions' text_offset

        def chunk(text: str | None, finish_reason=None, role=False, logprobs=()):
            nonlocal offset
            lp = None
            if job.stream.params.logprobs is not None:
                lp = chat_logprobs(tokenizer, logprobs) if kind.chat else \
                    completion_logprobs(tokenizer, logprobs, offset)
                offset += sum(len(t) for t in lp["tokens"]) if not kind.chat else 0
            if kind.chat:
                delta = {"role": "assistant", "content": ""} if role else \
                    ({"content": text} if text or logprobs else {})
                choice = {"index": 0, "delta": delta, "logprobs": None if role else lp,
                          "finish_reason": finish_reason}
            else:
                choice = {"index": 0, "text": text or "", "logprobs": lp,
                          "finish_reason": finish_reason}
            return {**head, "choices": [choice]}

        if kind.chat:
            yield sse_event(chunk(None, role=True))
        while True:
            out: Output = await queue.get()
            if out.finish_reason in ("abort", "error"):
                message = job.error or ("the request was cancelled: the server is shutting "
                                        "down and --shutdown-timeout has passed")
                yield sse_event({"error": {"message": message, "type": "server_error",
                                           "param": None, "code": out.finish_reason}})
                yield "data: [DONE]\n\n"
                return
            if (out.text or out.logprobs) and not out.finished:
                yield sse_event(chunk(out.text, logprobs=out.logprobs))
            if out.finished:
                usage, metrics = result_extras(job)
                yield sse_event({**chunk(out.text, out.finish_reason, logprobs=out.logprobs),
                                 "metrics": metrics})
                if include_usage:  # as OpenAI: a last chunk, empty choices, with usage
                    yield sse_event({**head, "choices": [], "usage": usage})
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
        lp = None
        if s.params.logprobs is not None:
            lp = chat_logprobs(tokenizer, s.logprobs) if kind.chat else \
                completion_logprobs(tokenizer, s.logprobs, 0)
        if kind.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": s.text},
                      "logprobs": lp, "finish_reason": s.finish_reason}
        else:
            choice = {"index": 0, "text": s.text, "logprobs": lp,
                      "finish_reason": s.finish_reason}
        usage, metrics = result_extras(job)
        return {"id": job.id, "object": kind.object, "created": created, "model": model_name,
                "choices": [choice], "usage": usage, "metrics": metrics}

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


def result_extras(job: Job) -> tuple[dict, dict]:
    """usage (OpenAI) and metrics (this server's extension: method, k, tau, acceptance)."""
    s = job.stream
    m = s.metrics()
    usage = {"prompt_tokens": len(s.prompt_ids), "completion_tokens": len(s.output_ids),
             "total_tokens": len(s.prompt_ids) + len(s.output_ids),
             # as OpenAI's: prompt tokens whose KV came from the prefix cache
             "prompt_tokens_details": {"cached_tokens": s.stats.cached_tokens}}
    keep = ("method", "num_draft_tokens", "cached_tokens", "tau", "proposed_tokens",
            "accepted_tokens",
            "acceptance_per_position", "time_to_first_token_s", "decode_tokens_per_s",
            "drafted_by")
    d = m.to_dict()
    return usage, {k: d[k] for k in keep}


def _token(tokenizer, token_id: int) -> tuple[str, list[int]]:
    raw = tokenizer.token_bytes(token_id)
    return raw.decode("utf-8", errors="replace"), list(raw)


def chat_logprobs(tokenizer, logprobs: list[TokenLogprob]) -> dict:
    """OpenAI's chat `logprobs`: {"content": [{token, logprob, bytes, top_logprobs}]}."""
    def entry(token_id: int, logprob: float) -> dict:
        text, raw = _token(tokenizer, token_id)
        return {"token": text, "logprob": logprob, "bytes": raw}

    return {"content": [{**entry(lp.token_id, lp.logprob),
                         "top_logprobs": [entry(t, v) for t, v in lp.top]}
                        for lp in logprobs], "refusal": None}


def completion_logprobs(tokenizer, logprobs: list[TokenLogprob], offset: int) -> dict:
    """OpenAI's completions `logprobs`: tokens, token_logprobs, top_logprobs, text_offset."""
    tokens = [_token(tokenizer, lp.token_id)[0] for lp in logprobs]
    offsets = []
    for t in tokens:
        offsets.append(offset)
        offset += len(t)
    return {"tokens": tokens, "token_logprobs": [lp.logprob for lp in logprobs],
            "top_logprobs": [{_token(tokenizer, t)[0]: v for t, v in lp.top}
                             for lp in logprobs],
            "text_offset": offsets}


def serve(scheduler: Scheduler, model_name: str, host: str, port: int,
          shutdown_timeout: float, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> None:
    """Runs until SIGINT / SIGTERM (uvicorn's handlers: a graceful shutdown)."""
    import uvicorn

    class Server(uvicorn.Server):
        async def shutdown(self, sockets=None):
            # Past --shutdown-timeout the scheduler stops: every request left ends with
            # "abort" (an error event and [DONE], or a 503), and the responses finish by
            # themselves before uvicorn's own, later, deadline would cancel them mid-write.
            loop = asyncio.get_running_loop()
            timer = loop.call_later(shutdown_timeout, scheduler.stop, 0)
            try:
                await super().shutdown(sockets)
            finally:
                timer.cancel()

    app = create_app(scheduler, model_name, max_body_bytes=max_body_bytes)
    config = uvicorn.Config(app, host=host, port=port, log_level="warning",
                            timeout_graceful_shutdown=shutdown_timeout + 10)
    # uvicorn handles the signal while it runs, then raises it again under the handlers it
    # found; these make that a no-op, so a graceful shutdown exits with status 0.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: None)
    Server(config).run()


def serve_engine(options: ServeOptions, say=print) -> None:
    """`trt-spec serve`: the engine folder's Generator (one KV-cache slot per
    --max-num-seqs, --max-model-len rows each) behind one Scheduler and the HTTP server, until
    SIGINT / SIGTERM. `say` gets the line naming what is served where. ValueError for an engine
    folder or setting that cannot run, before anything listens."""
    from trt_spec.runtime.generator import Generator

    gen = Generator(options.engine, options.runtime)
    gen.cache.reserve()  # resident from the start: kept slots fill all of it in time
    scheduler = Scheduler(gen, options.debug_step_delay)
    name = options.model_name
    say(f"serving {name} ({options.engine}; methods: {', '.join(scheduler.methods)}) on "
        f"http://{options.host}:{options.port}")
    serve(scheduler, name, options.host, options.port, options.shutdown_timeout,
          options.max_body_bytes)
