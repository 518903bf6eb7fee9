"""One access-log line per request (--access-log), and its id, as the app's outermost ASGI
middleware (serve/server.py):

    request      ──>  RequestLog: the id from `x-request-id` (a new one where it is absent or
                      is not 1-128 visible ASCII characters), timer started, an AccessEntry
                      made the request's (a context variable: the route, its error handlers
                      and what they call run in the request's task, or a copy of its context)
    the routes   ──>  note(model=..., jobs=...): what only they know (endpoint.py: the model
                      asked for, the scheduler requests that answered; server.py and
                      access.py: an error's code), with no request object to pass along
    response     <──  `x-request-id` added to its headers (not under Ray Serve, whose proxy
                      adds it: the id it passed in, the client's or its own); the line is
                      written when the response has ended (a stream: after its last
                      event), or raised

The line's fields (serve/logs.py writes them as key=value or as JSON):

    request_id, route ("POST /v1/chat/completions"), status, model, method (the speculative
    method(s) of its choices), prompt_tokens, cached_tokens, completion_tokens (as `usage`),
    ttft_s (first choice's time to first token, from its queueing), total_s (from the
    request's first byte read to its response's last byte sent), tau (tokens per target
    forward over its choices), finish_reason (its choices', "cancelled" for one that had not
    finished: the client left), error (the error's code, else its type) and error_param
    (the request field it names)

What is never in it: a header (the API key travels in Authorization), the query string, the
body. The numbers come from choices that finished (a cancelled one is still on the
scheduler's thread, and is not read).
"""

from __future__ import annotations

import contextvars
import logging
import re
import time
import uuid
from dataclasses import dataclass, field

from trt_spec.serve.logs import ACCESS
from trt_spec.serve.streaming import usage

log = logging.getLogger(ACCESS)
HEADER = b"x-request-id"
GIVEN_ID = re.compile(rb"[\x21-\x7e]{1,128}")  # an id taken as sent: visible ASCII
# the AccessEntry of the request this task serves (None: outside a request, or an app
# without RequestLog)
CURRENT: contextvars.ContextVar["AccessEntry | None"] = contextvars.ContextVar(
    "trt_spec_access", default=None)
LONGEST = 256  # characters of a free-form value (a path, a model name) written to the log


@dataclass
class AccessEntry:
    """What one request's access line says, filled as the request goes."""

    request_id: str
    route: str
    model: str | None = None
    jobs: list = field(default_factory=list)  # its choices' scheduler Requests
    error: str | None = None  # the code (else the type) of the error it was answered with
    error_param: str | None = None  # the request field that error names

    def fields(self, status: int | None, total_s: float) -> dict:
        """The line's fields (see the module docstring); None where there is no value."""
        done = [j for j in self.jobs if j.done]
        ms = [j.stream.metrics() for j in done]
        counts = usage(done) if done else {}
        forwards = [(m.tau, m.target_forwards) for m in ms if m.tau is not None]
        weight = sum(f for _, f in forwards)
        ttfts = [m.time_to_first_token_s for m in ms if m.time_to_first_token_s is not None]
        reasons = [j.stream.finish_reason if j.done else "cancelled" for j in self.jobs]
        return {"request_id": self.request_id, "route": self.route, "status": status,
                "model": self.model, "method": ",".join(dict.fromkeys(m.method for m in ms))
                or None,
                "prompt_tokens": counts.get("prompt_tokens"),
                "cached_tokens": counts.get("prompt_tokens_details", {}).get("cached_tokens"),
                "completion_tokens": counts.get("completion_tokens"),
                "ttft_s": round(ttfts[0], 6) if ttfts else None,
                "total_s": round(total_s, 6),
                "tau": round(sum(t * f for t, f in forwards) / weight, 4) if weight else None,
                "finish_reason": ",".join(dict.fromkeys(reasons)) or None,
                "error": self.error, "error_param": self.error_param}


def request_id(given: bytes | None) -> str:
    """The request's id: the client's x-request-id where it is a plain token, else a new
    one (32 hex digits) that the response's header returns."""
    if given is not None and GIVEN_ID.fullmatch(given):
        return given.decode("ascii")
    return uuid.uuid4().hex


def printable(text: str) -> str:
    """`text` cut to LONGEST characters, a control character written as its escape (a path
    with an encoded newline stays on one line)."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text[:LONGEST])


def note(**what) -> None:
    """Tells the access line of the request being served `what` (AccessEntry's fields); a
    no-op outside a request or in an app without RequestLog."""
    entry = CURRENT.get()
    if entry is None:
        return
    for name, value in what.items():
        if isinstance(value, str):
            value = printable(value)
        setattr(entry, name, value)


class RequestLog:
    """ASGI middleware: the request's id into its scope and (echo) its response's headers,
    and its access line at the end (when `enabled` and the trt_spec.access logger is on)."""

    def __init__(self, app, enabled: bool = True, echo: bool = True):
        self.app = app
        self.enabled = enabled
        self.echo = echo

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        t0 = time.perf_counter()
        rid = request_id(dict(scope["headers"]).get(HEADER))
        entry = AccessEntry(rid, printable(f"{scope['method']} {scope['path']}"))
        token = CURRENT.set(entry)
        status = None

        async def send_with_id(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            if message["type"] == "http.response.start" and self.echo:
                message = {**message, "headers": [*message.get("headers", []),
                                                  (HEADER, rid.encode("ascii"))]}
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        except BaseException:
            status = status or 500  # Starlette's outermost handler answers it
            raise
        finally:
            CURRENT.reset(token)
            if self.enabled and log.isEnabledFor(logging.INFO):
                log.info("%s %s", entry.route, status,
                         extra={"fields": entry.fields(status, time.perf_counter() - t0)})
