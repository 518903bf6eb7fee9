"""What one connection may hold of the server (ConnectionLimits, serve/options.py): uvicorn's
HTTP/1.1 protocol with the timers and bounds uvicorn lacks, and a cap on requests in flight.

    connection open ──keep_alive_timeout──> closed, if no byte of a request came
    first byte of a request ──header_timeout──> end of its headers     else 408, closed
    end of the headers ──body_timeout──> end of its body               else 408, closed
    request line + headers > max_header_bytes                          431, closed
    response sent ──keep_alive_timeout──> the next request's first byte, else closed
    a connection past max_connections                                  503, closed
    a request past max_concurrent_requests in flight                   503 (InFlightLimit)

Every answer the protocol writes itself is OpenAI's error JSON, with `Connection: close`.

The protocol is uvicorn's h11 one, pinned (`serve` passes it as uvicorn's `http`): uvicorn
would pick httptools where it is installed, which has no bound on a header's size, and
neither of uvicorn's protocols has a header or body timeout; h11 exposes the state these
timers follow (h11.Connection.their_state: IDLE while the head is read, SEND_BODY while the
body is, DONE after). Measured on the 2-core test VM, a keep-alive GET /health took 0.70 ms
median through it against 0.54-0.62 ms through httptools: a tenth of a millisecond, small
beside a model step. The subclass overrides H11Protocol's hooks (connection_made, data_received,
on_response_complete, send_400_response) and reads its conn, cycle and connections
(uvicorn 0.55); tests/test_server_connections.py holds each bound over raw sockets.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from trt_spec.serve.options import ConnectionLimits
from trt_spec.serve.protocol import RequestError

log = logging.getLogger("trt_spec.server")
REASONS = {400: "Bad Request", 408: "Request Timeout", 431: "Request Header Fields Too Large",
           503: "Service Unavailable"}
# cheap answers a probe or a scraper must always get, however busy the server is
UNLIMITED = frozenset({"/health", "/metrics"})


def error_json(message: str, status: int, code: str) -> bytes:
    return json.dumps(RequestError(message, status=status, code=code).body()).encode()


def raw_response(status: int, body: bytes) -> bytes:
    """A whole HTTP/1.1 answer written past h11, for a connection that has no request h11
    would let us answer (its head is not whole), and that is closed right after."""
    return (f"HTTP/1.1 {status} {REASONS[status]}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\nconnection: close\r\n\r\n").encode() + body


class RecordingConnection(h11.Connection):
    """h11's connection with a bound on a request's head, which keeps the protocol error it
    raised (uvicorn drops it), so the answer can say why and use its status (431 for a head
    past the bound). h11's own bound (max_incomplete_event_size) holds only for a head still
    arriving; one that came whole in a read is checked here, from the bytes it took."""

    error: h11.RemoteProtocolError | None = None

    def __init__(self, max_head_bytes: int):
        super().__init__(h11.SERVER, max_incomplete_event_size=max_head_bytes)
        self.max_head_bytes = max_head_bytes

    def next_event(self):
        try:
            if self.their_state is not h11.IDLE:
                return super().next_event()
            before = len(self.trailing_data[0])
            event = super().next_event()
            if (isinstance(event, h11.Request)
                    and before - len(self.trailing_data[0]) > self.max_head_bytes):
                raise h11.RemoteProtocolError("request head too large", error_status_hint=431)
            return event
        except h11.RemoteProtocolError as e:
            self.error = e
            raise


class LimitedH11Protocol(H11Protocol):
    """uvicorn's H11Protocol under `limits` (set on the subclass protocol_class makes)."""

    limits: ConnectionLimits
    refusal_logged_at = -1e9  # time.monotonic() of the last "connections refused" warning

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.conn = RecordingConnection(self.limits.max_header_bytes)
        self.head_timer: asyncio.TimerHandle | None = None
        self.body_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport):
        super().connection_made(transport)
        if len(self.connections) > self.limits.max_connections:
            now = time.monotonic()
            if now - LimitedH11Protocol.refusal_logged_at > 10:  # a flood logs once per 10 s
                LimitedH11Protocol.refusal_logged_at = now
                log.warning("connections refused: %d open, --max-connections %d",
                            len(self.connections), self.limits.max_connections)
            body = error_json(f"the server holds its limit of {self.limits.max_connections} "
                              "connections (--max-connections); retry later", 503,
                              "too_many_connections")
            transport.write(raw_response(503, body))
            transport.close()
            return
        # a connection that never sends a byte is idle, as one between requests is
        self.timeout_keep_alive_task = self.loop.call_later(self.timeout_keep_alive,
                                                            self.timeout_keep_alive_handler)

    def connection_lost(self, exc):
        self.head_timer = cancel(self.head_timer)
        self.body_timer = cancel(self.body_timer)
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self.follow()

    def on_response_complete(self) -> None:
        super().on_response_complete()  # may read a pipelined request already received
        self.follow()

    def follow(self) -> None:
        """Arms or stops the head and body timers after h11 has read what came."""
        if self.transport.is_closing():
            return
        state = self.conn.their_state
        if state is h11.IDLE:  # the head is not whole: timed from its first byte
            if self.head_timer is None and self.conn.trailing_data[0]:
                self.head_timer = self.loop.call_later(self.limits.header_timeout,
                                                       self.head_timed_out)
            return
        self.head_timer = cancel(self.head_timer)
        if state is h11.SEND_BODY:
            if self.body_timer is None:
                self.body_timer = self.loop.call_later(self.limits.body_timeout,
                                                       self.body_timed_out)
        else:
            self.body_timer = cancel(self.body_timer)

    def head_timed_out(self) -> None:
        self.head_timer = None
        if self.transport.is_closing() or self.conn.their_state is not h11.IDLE:
            return
        body = error_json(f"the request's headers did not arrive within "
                          f"{self.limits.header_timeout:g} s (--header-timeout)", 408,
                          "request_timeout")
        self.transport.write(raw_response(408, body))
        self.transport.close()

    def body_timed_out(self) -> None:
        """408 when the app has not answered yet (it is waiting for the body); either way
        the app sees the client gone and the connection closes."""
        self.body_timer = None
        cycle = self.cycle
        if self.transport.is_closing() or self.conn.their_state is not h11.SEND_BODY:
            return
        if cycle is not None and not cycle.response_started:
            body = error_json(f"the request's body did not arrive within "
                              f"{self.limits.body_timeout:g} s (--body-timeout)", 408,
                              "request_timeout")
            self.write_error(408, body)
            cycle.response_started = cycle.response_complete = True
        if cycle is not None:
            cycle.disconnected = True
            cycle.message_event.set()
        self.transport.close()

    def send_400_response(self, msg: str) -> None:
        """uvicorn's answer to a request h11 cannot read, as JSON, with h11's status (431 for
        a head past --max-header-bytes)."""
        error = self.conn.error
        status = error.error_status_hint if error is not None else 400
        if status == 431:
            body = error_json(f"the request line and headers exceed "
                              f"{self.limits.max_header_bytes} bytes (--max-header-bytes)",
                              431, "headers_too_large")
        else:
            status = 400
            why = f": {error}" if error is not None and str(error) else ""
            body = error_json(f"malformed HTTP request{why}", 400, "invalid_http")
        self.write_error(status, body)
        self.transport.close()

    def write_error(self, status: int, body: bytes) -> None:
        headers = [(b"content-type", b"application/json"),
                   (b"content-length", str(len(body)).encode()), (b"connection", b"close")]
        try:
            self.transport.write(self.conn.send(h11.Response(
                status_code=status, headers=headers, reason=REASONS[status].encode())))
            self.transport.write(self.conn.send(h11.Data(data=body)))
            self.transport.write(self.conn.send(h11.EndOfMessage()))
        except h11.LocalProtocolError:  # h11 cannot answer in its state: write it raw
            self.transport.write(raw_response(status, body))


def cancel(timer: asyncio.TimerHandle | None) -> None:
    if timer is not None:
        timer.cancel()


def protocol_class(limits: ConnectionLimits) -> type[LimitedH11Protocol]:
    """The protocol uvicorn runs (its `http`), bound to `limits`."""
    return type("LimitedH11Protocol", (LimitedH11Protocol,), {"limits": limits})


def uvicorn_limits(limits: ConnectionLimits) -> dict:
    """uvicorn.Config's own settings for `limits` (its keep-alive timer between requests)."""
    return {"http": protocol_class(limits), "timeout_keep_alive": limits.keep_alive_timeout,
            "h11_max_incomplete_event_size": limits.max_header_bytes}


class InFlightLimit:
    """ASGI middleware: past `limit` requests in flight (a stream counts until it ends), a 503
    in OpenAI's error shape with Retry-After; /health and /metrics always answer."""

    def __init__(self, app, limit: int, metrics=None):
        self.app, self.limit, self.metrics = app, limit, metrics
        self.in_flight = 0

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] in UNLIMITED:
            return await self.app(scope, receive, send)
        if self.in_flight >= self.limit:
            if self.metrics is not None:
                self.metrics.rejected("overloaded")
            body = error_json(f"the server holds its limit of {self.limit} requests in "
                              "flight (--max-concurrent-requests); retry later", 503,
                              "server_overloaded")
            await send({"type": "http.response.start", "status": 503,
                        "headers": [(b"content-type", b"application/json"),
                                    (b"content-length", str(len(body)).encode()),
                                    (b"retry-after", b"1")]})
            await send({"type": "http.response.body", "body": body})
            return
        self.in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.in_flight -= 1
