"""Prefix routing's two Ray-free halves: the key a request is routed by (serve/affinity.py) and
the relay that carries a request to an ASGI app and its answer back (serve/asgi_relay.py)."""

import asyncio
import json
from collections import Counter

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from trt_spec.serve.affinity import OPENING_CHARS, rank, route_key
from trt_spec.serve.asgi_relay import read_request, run_asgi, write_response

CHAT = "/v1/chat/completions"


def key(path, body):
    return route_key(path, json.dumps(body).encode())


def test_every_turn_of_a_chat_has_the_key_of_its_first():
    system = {"role": "system", "content": "You are terse."}
    turns = [system, {"role": "user", "content": "Paste: " + "x " * 800}]
    first = key(CHAT, {"model": "m", "messages": turns, "max_tokens": 8})
    for answer, question in [("A one.", "And?"), ("A two.", "Then?")]:
        turns += [{"role": "assistant", "content": answer}, {"role": "user", "content": question}]
        # later turns change everything but the opening: sampling fields too
        assert key(CHAT, {"model": "m", "messages": turns, "temperature": 0.7}) == first
    other = [system, {"role": "user", "content": "Another chat"}]
    assert key(CHAT, {"messages": other}) != first  # the same system prompt alone is no key
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    assert key(CHAT, {"messages": other, "tools": tools}) != key(CHAT, {"messages": other})


def test_completions_prompts_that_extend_each_other_share_a_key():
    text = "Once upon a time " * 40
    assert len(text) > OPENING_CHARS
    k = key("/v1/completions", {"prompt": text})
    assert key("/v1/completions", {"prompt": text + " and then"}) == k
    assert key("/v1/completions", {"prompt": [text + "!", "other"]}) == k  # the first prompt's
    assert key("/v1/completions", {"prompt": "Twice upon a time"}) != k
    ids = list(range(300))
    assert key("/v1/completions", {"prompt": ids}) == key("/v1/completions",
                                                          {"prompt": ids + [7, 8]})
    assert key("/v1/completions", {"prompt": [ids, [1]]}) == key("/v1/completions",
                                                                 {"prompt": ids})


@pytest.mark.parametrize("path, body", [
    ("/v1/models", b""), ("/metrics", b""), ("/tokenize", b'{"prompt": "a"}'),
    (CHAT, b"{not json"), (CHAT, b"[1, 2]"), (CHAT, b'{"messages": []}'),
    ("/v1/completions", b'{"prompt": 5}'), (CHAT, b"\xff\xfe"),
    (CHAT, b'{"messages": ' + b"[" * 100000 + b"]" * 100000 + b"}")])  # past the recursion limit
def test_requests_without_a_key_go_by_load(path, body):
    assert route_key(path, body) is None


def test_rendezvous_ranks_spread_keys_and_move_only_a_lost_replicas():
    replicas = ["r1", "r2", "r3"]
    keys = [key(CHAT, {"messages": [{"role": "user", "content": f"chat {i}"}]})
            for i in range(3000)]
    firsts = {k: rank(k, replicas)[0] for k in keys}
    assert all(sorted(rank(k, replicas)) == replicas for k in keys[:50])
    assert rank(keys[0], replicas) == rank(keys[0], list(reversed(replicas)))  # order-free
    shares = Counter(firsts.values())
    assert all(800 < shares[r] < 1200 for r in replicas), shares  # 1000 each expected
    after = {k: rank(k, ["r1", "r3"])[0] for k in keys}
    moved = [k for k in keys if after[k] != firsts[k]]
    assert moved and all(firsts[k] == "r2" for k in moved)  # only r2's keys move


def app_under_test():
    app = FastAPI()
    seen = {}

    @app.post("/echo")
    async def echo(request: Request):
        body = await request.json()
        return JSONResponse({"got": body, "query": request.url.query,
                             "auth": request.headers.get("authorization")}, status_code=201)

    @app.post("/stream")
    async def stream(request: Request):
        async def chunks():
            try:
                for i in range(1000):
                    yield f"data: {i}\n\n"
                    await asyncio.sleep(0.001)
                yield "data: [DONE]\n\n"
            except asyncio.CancelledError:
                seen["cancelled"] = True
                raise
        return StreamingResponse(chunks(), media_type="text/event-stream")

    return app, seen


def head(path, body=b"", query=b""):
    return {"method": "POST", "path": path, "query_string": query,
            "headers": [(b"content-type", b"application/json"),
                        (b"authorization", b"Bearer k"),
                        (b"content-length", str(len(body)).encode())],
            "client": ["127.0.0.1", 5000]}


def collect(app, h, body):
    async def go():
        return [p async for p in run_asgi(app, h, body)]
    return asyncio.run(go())


def test_the_relay_carries_a_request_and_its_answer_whole():
    app, _ = app_under_test()
    parts = collect(app, head("/echo", b'{"a": 1}', b"x=2"), b'{"a": 1}')
    assert parts[0]["status"] == 201
    assert json.loads(b"".join(parts[1:])) == {"got": {"a": 1}, "query": "x=2",
                                              "auth": "Bearer k"}
    parts = collect(app, head("/stream"), b"")
    text = b"".join(parts[1:]).decode()
    assert text.count("data: ") == 1001 and text.endswith("data: [DONE]\n\n")
    assert dict(parts[0]["headers"])[b"content-type"].startswith(b"text/event-stream")


def test_a_reader_that_stops_early_cancels_the_app():
    app, seen = app_under_test()

    async def go():
        parts = run_asgi(app, head("/stream"), b"")
        got = [await parts.__anext__() for _ in range(3)]
        await parts.aclose()  # the client went away
        return got

    got = asyncio.run(go())
    assert got[0]["status"] == 200 and got[1] == b"data: 0\n\n"
    assert seen.get("cancelled")


async def replay_into(parts):
    sent = []

    async def send(message):
        sent.append(message)

    async def source():
        for p in parts:
            if isinstance(p, Exception):
                raise p
            yield p
    return sent, send, source()


def run_write(parts):
    async def go():
        sent, send, source = await replay_into(parts)
        error = None
        try:
            await write_response(send, source, lambda e: (503, f"gone: {e}"))
        except Exception as e:  # noqa: BLE001
            error = e
        return sent, error
    return asyncio.run(go())


def test_a_failed_replica_is_a_5xx_before_the_answer_and_a_cut_stream_after():
    sent, error = run_write([RuntimeError("dead")])  # before anything was sent
    assert error is None and sent[0]["status"] == 503
    assert json.loads(sent[1]["body"])["error"] == {
        "message": "gone: dead", "type": "server_error", "param": None, "code": 503}

    sse = {"status": 200, "headers": [(b"content-type", b"text/event-stream")]}
    sent, error = run_write([sse, b"data: 1\n\n", RuntimeError("dead")])
    assert isinstance(error, RuntimeError)  # the server cuts the connection: no clean end
    bodies = [m["body"] for m in sent if m["type"] == "http.response.body"]
    assert bodies[0] == b"data: 1\n\n" and b'"error"' in bodies[1]
    assert all(m.get("more_body") for m in sent if m["type"] == "http.response.body")

    sent, error = run_write([{"status": 200, "headers": []}, b"{}"])
    assert error is None and sent[-1] == {"type": "http.response.body", "body": b"",
                                          "more_body": False}


def test_the_ingress_reads_a_request_in_chunks():
    messages = [{"type": "http.request", "body": b'{"a"', "more_body": True},
                {"type": "http.request", "body": b": 1}", "more_body": False}]

    async def receive():
        return messages.pop(0)

    scope = {"method": "POST", "path": "/v1/completions", "query_string": b"",
             "headers": [(b"host", b"x")], "client": ("1.2.3.4", 9)}
    h, body = asyncio.run(read_request(scope, receive))
    assert body == b'{"a": 1}' and h["path"] == "/v1/completions"
    assert h["client"] == ["1.2.3.4", 9] and h["headers"] == [(b"host", b"x")]

    async def gone():
        return {"type": "http.disconnect"}
    with pytest.raises(ConnectionError):
        asyncio.run(read_request(scope, gone))
