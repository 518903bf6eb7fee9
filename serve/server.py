"""`trt-spec serve`: an OpenAI-compatible HTTP server on FastAPI + uvicorn.

    POST /v1/completions, /v1/chat/completions   (stream: true -> server-sent events)
    POST /v1/responses                            (OpenAI's Responses API, stateless)
    POST /tokenize, /detokenize; GET /tokenizer_info   (vLLM's tokenizer routes)
    GET  /v1/models, /health, /metrics            (Prometheus text)
    GET  /                                        the browser page (serve/page.py)

Every request goes to one Scheduler, whose loop runs in its own thread: the event loop only
parses, queues and forwards deltas (`on_output` -> `loop.call_soon_threadsafe` -> an
asyncio.Queue per request), so a model step never blocks it. A client that disconnects
cancels its request, which frees its KV slot at the next step. On SIGTERM uvicorn stops
accepting connections and waits (up to --shutdown-timeout) for in-flight responses to
finish; past it the scheduler stops, ending whatever is left with "abort": a stream gets a
last error event and [DONE], a full response a 503.

No single request can stall the others: a request's head and body must arrive within
--header-timeout and --body-timeout, an idle connection is closed (serve/connection.py), the
body is read up to --max-body-bytes (413 past it), prompts are tokenized and chat templates
rendered on worker threads (the tokenizer releases the GIL), a prompt that cannot fit the
context is refused from its size before tokenizing, and a long prompt is prefilled in chunks
(Scheduler.max_prefill_tokens).

    server.py       the app and its lifecycle: create_app (the scheduler thread started and
                    stopped with the app), error handlers, /health, /metrics, /v1/models;
                    serve / serve_engine (uvicorn)
    completions.py  POST /v1/completions        chat.py  POST /v1/chat/completions
    responses.py    POST /v1/responses: translated onto the chat path (responses_protocol.py,
                    its request; responses_stream.py, its output items and events)
    tokenize.py     POST /tokenize, /detokenize, GET /tokenizer_info
    access.py       the API key (--api-key) and CORS (--allowed-origins), as middleware
    request_log.py  the request's id (x-request-id) and its access-log line, outermost;
                    logs.py: the log's handler and format (--log-format)
    connection.py   what one connection may hold: header and body timeouts, idle
                    keep-alive, header size, connections and requests in flight
    page.py         GET /: the browser page, serve/static/index.html
    endpoint.py     what both do with a request: body, size, the one check, queue, answer
    streaming.py    the answer from the scheduler's Outputs: server-sent events or one body
    protocol.py     request bodies and their checks (request_body.py: bytes -> a request);
                    metrics.py: Prometheus
"""

from __future__ import annotations

import asyncio
import logging
import signal
from contextlib import asynccontextmanager

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from trt_spec.runtime.scheduler import Scheduler
from trt_spec.runtime.settings import DEFAULT_MAX_BODY_BYTES
from trt_spec.serve import chat, completions, page, responses, tokenize
from trt_spec.serve.endpoint import Served, served
from trt_spec.serve.metrics import ServerMetrics
from trt_spec.serve.access import add_access
from trt_spec.serve.connection import InFlightLimit, uvicorn_limits
from trt_spec.serve.options import Access, ConnectionLimits, ServeOptions
from trt_spec.serve.protocol import RequestError
from trt_spec.serve.request_log import RequestLog, note

log = logging.getLogger("trt_spec.server")
ROUTES = "POST /v1/completions, POST /v1/chat/completions, POST /v1/responses, " \
         "GET /v1/models, POST /tokenize, " \
         "POST /detokenize, GET /tokenizer_info, GET /health, GET /metrics, GET / (the page)"


def create_app(scheduler: Scheduler, model_name: str, start_loop: bool = True,
               max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, access: Access = Access(),
               reasoning_in_content: bool = False, docs: bool = False,
               max_concurrent_requests: int | None = None,
               access_log: bool = True, echo_request_id: bool = True) -> FastAPI:
    """The FastAPI app serving `scheduler` as `model_name`; its lifespan starts the
    scheduler's thread (start_loop; False: the caller steps it) and stops it. access: the
    API key and CORS origins (serve/access.py); reasoning_in_content: a thinking section
    stays in `content` (no `reasoning_content`); docs: serve /docs, /redoc and
    /openapi.json (off: nothing about the API is published, and Swagger's page loads its
    scripts from a CDN); max_concurrent_requests: past it in flight, 503
    (serve/connection.py; None: no cap, as under Ray Serve, whose replicas have their own);
    access_log: a line per request (serve/request_log.py); echo_request_id: every answer
    carries its x-request-id (off under Ray Serve, whose proxy adds the same header).

    No route redirects: a path with a trailing slash is a 404 like any unknown path, since
    Starlette's redirect would name the host the request's Host header gave."""
    if not isinstance(max_body_bytes, int) or max_body_bytes < 1:
        raise ValueError(f"max_body_bytes={max_body_bytes!r}: must be an integer >= 1")
    metrics = ServerMetrics(scheduler, model_name)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        if start_loop:
            scheduler.start()
        yield
        scheduler.stop(timeout=30)

    published = {} if docs else {"docs_url": None, "redoc_url": None, "openapi_url": None}
    app = FastAPI(title="trt-spec", lifespan=lifespan, redirect_slashes=False, **published)
    app.state.served = Served(scheduler, model_name, metrics, max_body_bytes,
                              reasoning_in_content)
    add_error_handlers(app, metrics)
    add_access(app, access, metrics)
    if max_concurrent_requests is not None:  # outermost: counts every request, refused or not
        app.add_middleware(InFlightLimit, limit=max_concurrent_requests, metrics=metrics)
    # outermost: every answer has an id
    app.add_middleware(RequestLog, enabled=access_log, echo=echo_request_id)
    for routes in (router, completions.router, chat.router, responses.router, tokenize.router):
        app.include_router(routes)
    app.include_router(page.router)  # GET /: the browser page, open without the key
    return app


def add_error_handlers(app: FastAPI, metrics: ServerMetrics) -> None:
    """Every error as OpenAI's JSON ({"error": {message, type, param, code}}), counted."""
    def error(e: RequestError) -> JSONResponse:
        note(error=e.code or e.body()["error"]["type"], error_param=e.param)
        if e.status < 500:  # a client gone mid-body was refused nothing: counted apart
            metrics.rejected("queue_full" if e.status == 429 else "disconnected"
                             if e.code == "client_disconnected" else "invalid")
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    @app.exception_handler(RequestError)
    async def on_request_error(request: Request, e: RequestError):
        return error(e)

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: Request, e: StarletteHTTPException):
        return error(RequestError(f"{request.method} {request.url.path}: {e.detail}; this "
                                  f"server has {ROUTES}", status=e.status_code))

    @app.exception_handler(ClientDisconnect)
    async def on_client_gone(request: Request, e: ClientDisconnect):
        # the client went away mid-body, or its body timed out (serve/connection.py, which
        # answered the 408): no one reads this answer, and it is no server error
        return Response(status_code=499)  # nginx's "client closed request"; never sent

    @app.exception_handler(Exception)
    async def on_bug(request: Request, e: Exception):
        # a bug, not the client's fault: still OpenAI's JSON, and counted
        log.error("%s %s: %s: %s", request.method, request.url.path, type(e).__name__, e)
        note(error="internal_error")
        metrics.rejected("error")
        return JSONResponse(RequestError(f"internal error: {type(e).__name__}: {e}",
                                         status=500, code="internal_error").body(),
                            status_code=500)


router = APIRouter()  # the app's own routes: health, metrics, models


@router.get("/health")
async def health(request: Request):
    if not served(request).scheduler.alive:
        return JSONResponse({"status": "stopped"}, status_code=503)
    return {"status": "ok"}


@router.get("/metrics")
async def prometheus(request: Request):
    return Response(served(request).metrics.render(), media_type=CONTENT_TYPE_LATEST)


@router.get("/v1/models")
async def models(request: Request):
    ctx = served(request)
    return {"object": "list", "data": [{
        "id": ctx.model_name, "object": "model", "created": 0, "owned_by": "trt-spec",
        "max_model_len": ctx.scheduler.max_len, "methods": ctx.scheduler.methods}]}


def serve(scheduler: Scheduler, model_name: str, host: str, port: int,
          shutdown_timeout: float, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
          access: Access = Access(), reasoning_in_content: bool = False, docs: bool = False,
          limits: ConnectionLimits = ConnectionLimits(), access_log: bool = True) -> None:
    """Runs until SIGINT / SIGTERM (uvicorn's handlers: a graceful shutdown). limits: what
    one connection may hold (serve/connection.py: uvicorn's h11 protocol with them).
    uvicorn leaves logging as it is (serve/logs.py configures it) and writes no access log
    of its own (request_log.py writes one)."""
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

    app = create_app(scheduler, model_name, max_body_bytes=max_body_bytes, access=access,
                     reasoning_in_content=reasoning_in_content, docs=docs,
                     max_concurrent_requests=limits.max_concurrent_requests,
                     access_log=access_log)
    config = uvicorn.Config(app, host=host, port=port, log_config=None, access_log=False,
                            timeout_graceful_shutdown=shutdown_timeout + 10,
                            **uvicorn_limits(limits))
    # uvicorn handles the signal while it runs, then raises it again under the handlers it
    # found; these make that a no-op, so a graceful shutdown exits with status 0.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: None)
    Server(config).run()


def serve_engine(options: ServeOptions, say=print) -> None:
    """`trt-spec serve`: the engine folder's Generator (one KV-cache slot per
    --max-num-seqs, --max-model-len rows each) behind one Scheduler and the HTTP server, until
    SIGINT / SIGTERM. `say` gets what the weights and caches take (runtime/memory.py) and the
    line naming what is served where. ValueError for an engine folder or setting that cannot
    run (one whose weights and caches do not fit in memory: before any graph is read),
    before anything listens."""
    from trt_spec.runtime.generator import Generator
    from trt_spec.serve.logs import configure_logging

    configure_logging(options.log_format, options.access_log)
    gen = Generator(options.engine, options.runtime)  # refuses what does not fit in memory
    gen.cache.reserve()  # resident from the start: kept slots fill all of it in time
    scheduler = Scheduler(gen, options.debug_step_delay)
    name = options.model_name
    for line in gen.memory.table(gen.memory_available):
        say(line)
    say(f"serving {name} ({options.engine}; methods: {', '.join(scheduler.methods)}) on "
        f"http://{options.host}:{options.port}")
    serve(scheduler, name, options.host, options.port, options.shutdown_timeout,
          options.max_body_bytes, options.access, options.reasoning_in_content, options.docs,
          options.limits, options.access_log)
