"""An HTTP request carried to an ASGI app in another process, and its answer carried back as it
is written: the two halves of the relay behind `serve --ray --routing prefix`.

    head, body = await read_request(scope, receive)     # ingress: the whole request
    async for part in run_asgi(app, head, body): ...    # replica: {"status", "headers"}, bytes...
    await write_response(send, parts)                   # ingress: the answer, streamed

`head` is plain data (method, path, query, headers, client) so it pickles; the replica's app
sees an ordinary ASGI request, and a client that goes away mid-answer is an
`http.disconnect` to it (the relay's consumer stops reading, the app is cancelled).
Ray-free: serve/ray_routing.py wires it to Ray Serve.
"""

from __future__ import annotations

import asyncio
import json
from typing import AsyncIterator


async def read_request(scope: dict, receive) -> tuple[dict, bytes]:
    """The request's head (picklable) and its whole body."""
    chunks = []
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ConnectionError("the client went away before its request was read")
        chunks.append(message.get("body", b""))
        if not message.get("more_body"):
            break
    head = {"method": scope["method"], "path": scope["path"],
            "query_string": scope.get("query_string", b""),
            "headers": [(bytes(k), bytes(v)) for k, v in scope.get("headers", [])],
            "client": list(scope["client"]) if scope.get("client") else None,
            "http_version": scope.get("http_version", "1.1"),
            "scheme": scope.get("scheme", "http")}
    return head, b"".join(chunks)


def http_scope(head: dict) -> dict:
    return {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"},
            "http_version": head.get("http_version", "1.1"), "method": head["method"],
            "scheme": head.get("scheme", "http"), "path": head["path"],
            "raw_path": head["path"].encode("utf-8"), "root_path": "",
            "query_string": head.get("query_string", b""), "headers": list(head["headers"]),
            "client": tuple(head["client"]) if head.get("client") else None,
            "server": None, "state": {}}


async def run_asgi(app, head: dict, body: bytes) -> AsyncIterator[dict | bytes]:
    """Runs one request through `app`: yields the response start ({"status", "headers"}),
    then each body chunk as the app sends it. Closing the iterator early (the client went
    away) tells the app the client disconnected, then cancels what is left of it."""
    sent: asyncio.Queue = asyncio.Queue()
    gone = asyncio.Event()
    read = False

    async def receive():
        nonlocal read
        if not read:
            read = True
            return {"type": "http.request", "body": body, "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message):
        await sent.put(message)

    task = asyncio.ensure_future(app(http_scope(head), receive, send))
    task.add_done_callback(lambda _: sent.put_nowait(None))
    finished = False
    try:
        while True:
            message = await sent.get()
            if message is None:  # the app returned (or raised) without finishing its answer
                task.result()
                raise RuntimeError("the app ended without finishing its response")
            if message["type"] == "http.response.start":
                yield {"status": message["status"], "headers": list(message.get("headers", []))}
            elif message["type"] == "http.response.body":
                if message.get("body"):
                    yield bytes(message["body"])
                if not message.get("more_body", False):
                    finished = True
                    return
    finally:
        gone.set()
        if not finished and not task.done():
            task.cancel()
        if not task.done():
            await asyncio.wait([task], timeout=5.0)


def error_body(status: int, message: str) -> bytes:
    """OpenAI's error shape, as the app's own errors."""
    kind = "server_error" if status >= 500 else "invalid_request_error"
    return json.dumps({"error": {"message": message, "type": kind, "param": None,
                                 "code": status}}).encode()


async def write_response(send, parts: AsyncIterator[dict | bytes], failed) -> None:
    """Sends what `run_asgi` yields (in another process) to the client. A failure before the
    answer started is a 5xx in OpenAI's error shape; after it started (a stream's 200 has
    left), an SSE error event ends an event stream and the answer is cut short, so the client
    never takes it for a whole one. `failed(exc)` -> (status, message) names the failure."""
    started, events = False, False
    try:
        async for part in parts:
            if isinstance(part, dict):
                headers = [(bytes(k), bytes(v)) for k, v in part["headers"]]
                events = any(k.lower() == b"content-type" and v.startswith(b"text/event-stream")
                             for k, v in headers)
                await send({"type": "http.response.start", "status": part["status"],
                            "headers": headers})
                started = True
            else:
                await send({"type": "http.response.body", "body": part, "more_body": True})
    except Exception as e:  # noqa: BLE001 - the replica or the way to it failed (a
        # cancellation, a BaseException, passes through)
        status, message = failed(e)
        if not started:
            body = error_body(status, message)
            await send({"type": "http.response.start", "status": status,
                        "headers": [(b"content-type", b"application/json"),
                                    (b"content-length", str(len(body)).encode())]})
            await send({"type": "http.response.body", "body": body})
            return
        if events:
            await send({"type": "http.response.body", "more_body": True,
                        "body": b"data: " + error_body(status, message) + b"\n\n"})
        raise  # the ASGI server cuts the connection: no clean end for a half answer
    if not started:
        raise RuntimeError("the replica sent no response")
    await send({"type": "http.response.body", "body": b"", "more_body": False})
