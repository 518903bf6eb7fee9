"""Who may call the server: the API key (`--api-key`) and CORS (`--allowed-origins`), as two
ASGI middlewares around the app (serve/server.py), outermost first:

    CORS      answers browsers' preflight requests (OPTIONS) and adds the Access-Control
              headers for the allowed origins, to every answer, a 401 included; a refused
              preflight (an origin, method or header not allowed) is a 400 in OpenAI's
              error shape, counted as request_rejected_total{reason="invalid"}
    ApiKey    every route but /health, / (the page, which asks for the key itself) and
              /metrics (unless --protect-metrics) needs `Authorization: Bearer KEY`; else a
              401 in OpenAI's error shape, counted in /metrics as
              request_rejected_total{reason="unauthorized"}

The key is compared in constant time (hmac.compare_digest) and never echoed.
"""

from __future__ import annotations

import hmac

from fastapi import FastAPI
from fastapi.responses import JSONResponse
from starlette.datastructures import Headers
from starlette.middleware.cors import CORSMiddleware
from starlette.responses import Response

from trt_spec.serve.metrics import ServerMetrics
from trt_spec.serve.options import Access
from trt_spec.serve.protocol import RequestError
from trt_spec.serve.request_log import note

# liveness probes carry no key; the page (serve/page.py) holds no data and asks for the key
OPEN = frozenset({"/health", "/"})


class ApiKey:
    """ASGI middleware: a request to a guarded path without the key gets a 401."""

    def __init__(self, app, access: Access, metrics: ServerMetrics):
        self.app = app
        self.key = access.api_key.encode("utf-8")
        self.open = OPEN if access.protect_metrics else OPEN | {"/metrics"}
        self.metrics = metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] in self.open:
            return await self.app(scope, receive, send)
        given = dict(scope["headers"]).get(b"authorization")
        scheme, _, token = (given or b"").partition(b" ")
        if scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.key):
            return await self.app(scope, receive, send)
        self.metrics.rejected("unauthorized")
        note(error="invalid_api_key")
        why = ("no API key: send the header Authorization: Bearer <key>" if given is None
               else "invalid API key in the Authorization header (expected: Bearer <key>)")
        error = RequestError(why, status=401, code="invalid_api_key")
        response = JSONResponse(error.body(), status_code=401,
                                headers={"WWW-Authenticate": "Bearer"})
        await response(scope, receive, send)


class Cors(CORSMiddleware):
    """Starlette's CORS, whose refused preflight (plain text "Disallowed CORS origin") is
    OpenAI's error JSON instead, keeping Starlette's CORS headers."""

    def __init__(self, app, metrics: ServerMetrics, **kwargs):
        super().__init__(app, **kwargs)
        self.metrics = metrics

    def preflight_response(self, request_headers: Headers) -> Response:
        answer = super().preflight_response(request_headers)
        if answer.status_code < 400:
            return answer
        self.metrics.rejected("invalid")
        what = answer.body.decode().removeprefix("Disallowed CORS ")  # origin, method, ...
        origin = request_headers.get("origin")
        error = RequestError(f"CORS preflight from origin {origin!r} refused: not allowed "
                             f"here: {what} (origins: the server's --allowed-origins; methods: "
                             f"{', '.join(sorted(self.allow_methods))})",
                             status=answer.status_code, code="cors_refused")
        headers = {k: v for k, v in answer.headers.items()
                   if k.lower() not in ("content-length", "content-type")}
        return JSONResponse(error.body(), status_code=answer.status_code, headers=headers)


def add_access(app: FastAPI, access: Access, metrics: ServerMetrics) -> None:
    """The key check, then CORS outside it (a preflight needs no key; a 401 carries CORS
    headers, so a browser client can read why)."""
    if access.api_key is not None:
        app.add_middleware(ApiKey, access=access, metrics=metrics)
    if access.allowed_origins:
        app.add_middleware(Cors, metrics=metrics, allow_origins=list(access.allowed_origins),
                           allow_methods=["GET", "POST", "OPTIONS"],
                           allow_headers=["Authorization", "Content-Type"], max_age=600)
