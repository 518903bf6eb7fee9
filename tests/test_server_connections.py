"""What one connection may hold of the server (serve/connection.py), seen over raw sockets: a
head or body that does not arrive in time gets a 408 and the connection closes, an idle
connection is closed, an oversized head gets a 431, requests past the in-flight cap and
connections past theirs get a 503, all in OpenAI's error JSON. And the smaller doors: no
redirect follows the Host header, the API's docs are off unless asked for, a refused CORS
preflight is JSON.

Timeouts are 1 s; each assertion only asks that the connection ends within BOUND seconds,
so a loaded machine cannot make them flake."""

import json
import socket
import time

import httpx
import pytest

from tests.server_util import start_server

BOUND = 10.0  # a 1 s timeout must have acted by then


@pytest.fixture(scope="module")
def server(tiny_engine, tmp_path_factory):
    log = tmp_path_factory.mktemp("connections") / "server.log"
    with open(log, "w") as f:
        s = start_server(tiny_engine, "--header-timeout", "1", "--body-timeout", "1",
                         "--keep-alive-timeout", "1", "--max-header-bytes", "4096", stderr=f)
    s.log = log
    yield s
    assert s.stop() == 0


@pytest.fixture(scope="module")
def capped(tiny_engine):
    """Two requests in flight, three connections; timeouts long enough to hold them."""
    s = start_server(tiny_engine, "--max-concurrent-requests", "2", "--max-connections", "3",
                     "--body-timeout", "60", "--keep-alive-timeout", "60", "--docs",
                     "--allowed-origins", "https://good.example")
    yield s
    assert s.stop() == 0


def connect(url: str) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=BOUND)
    return sock


def read_until_closed(sock: socket.socket) -> tuple[bytes, float]:
    """Everything the server writes until it closes the connection, and how long that took
    (a reset counts as closed)."""
    t0, data = time.time(), b""
    sock.settimeout(BOUND)
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except ConnectionResetError:
        pass
    except TimeoutError:
        pytest.fail(f"the connection was still open after {BOUND} s; got {data[:200]!r}")
    return data, time.time() - t0


def read_response(reader) -> tuple[int, dict, bytes]:
    """One response (status, headers, body) from a keep-alive connection's reader
    (socket.makefile("rb"): a second, pipelined answer stays in it)."""
    lines = []
    while (line := reader.readline()) not in (b"\r\n", b""):
        lines.append(line)
    assert lines, "the connection closed"
    status, headers = parse_head(b"".join(lines).rstrip(b"\r\n"))
    return status, headers, reader.read(int(headers.get("content-length", 0)))


def parse_head(head: bytes) -> tuple[int, dict]:
    lines = head.decode("latin-1").split("\r\n")
    headers = dict(line.split(": ", 1) for line in lines[1:])
    return int(lines[0].split()[1]), {k.lower(): v for k, v in headers.items()}


def error_of(data: bytes, status: int) -> dict:
    """The OpenAI error in a whole response `data`, checked to be `status` and closing."""
    head, _, body = data.partition(b"\r\n\r\n")
    got, headers = parse_head(head)
    assert got == status, data[:300]
    assert headers["content-type"] == "application/json"
    assert headers.get("connection") == "close"
    error = json.loads(body)["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


def test_headers_that_stop_arriving_get_408_and_the_connection_closes(server):
    with connect(server.url) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: localhost\r\nX-Slow: ")
        data, took = read_until_closed(sock)
    error = error_of(data, 408)
    assert error["code"] == "request_timeout" and "--header-timeout" in error["message"]


def test_a_body_that_stops_arriving_gets_408_and_the_connection_closes(server):
    body = json.dumps({"model": "tiny", "prompt": "a b", "max_tokens": 2}).encode()
    with connect(server.url) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\n"
                     b"Content-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n" % len(body) + body[:10])
        data, took = read_until_closed(sock)
    error = error_of(data, 408)
    assert error["code"] == "request_timeout" and "--body-timeout" in error["message"]
    assert httpx.get(f"{server.url}/health").status_code == 200
    # the app saw its client go: no server error, no traceback (test_the_log_holds_no_traceback)
    assert server.metric("trt_spec:request_rejected_total", reason="error") == 0


def test_idle_connections_are_closed(server):
    with connect(server.url) as sock:  # a new connection that sends nothing
        data, took = read_until_closed(sock)
    assert data == b""
    with connect(server.url) as sock:  # idle after its response (keep-alive)
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: localhost\r\n\r\n")
        status, headers, body = read_response(sock.makefile("rb"))
        assert status == 200 and json.loads(body) == {"status": "ok"}
        data, took = read_until_closed(sock)
    assert data == b""


@pytest.mark.parametrize("end", [b"\r\n\r\n", b""], ids=["whole", "still-arriving"])
def test_a_header_past_the_bound_gets_431(server, end):
    with connect(server.url) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: localhost\r\nX-Big: " + b"a" * 8000
                     + end)
        data, took = read_until_closed(sock)
    error = error_of(data, 431)
    assert error["code"] == "headers_too_large" and "4096" in error["message"]


def test_pipelined_requests_are_answered_in_order(server):
    with connect(server.url) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: localhost\r\n\r\n"
                     b"GET /v1/models HTTP/1.1\r\nHost: localhost\r\n\r\n")
        reader = sock.makefile("rb")
        assert json.loads(read_response(reader)[2]) == {"status": "ok"}
        assert json.loads(read_response(reader)[2])["data"][0]["id"] == "tiny"


def test_a_huge_header_is_not_buffered(server):
    """64 MiB of header: the server answers (or resets) long before it has read it all."""
    with connect(server.url) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: localhost\r\nX-Big: ")
        sent = 0
        try:
            while sent < 64 << 20:
                sock.sendall(b"a" * (1 << 20))
                sent += 1 << 20
        except (BrokenPipeError, ConnectionResetError):
            pass
        assert sent < 64 << 20, "the server read 64 MiB of one header"
    assert httpx.get(f"{server.url}/health").status_code == 200


def test_a_malformed_request_gets_400_json(server):
    with connect(server.url) as sock:
        sock.sendall(b"NOT HTTP AT ALL\r\n\r\n")
        data, _ = read_until_closed(sock)
    assert error_of(data, 400)["code"] == "invalid_http"


def test_no_redirect_follows_the_host_header(server):
    r = httpx.get(f"{server.url}/v1/models/", headers={"Host": "evil.example"})
    assert r.status_code == 404 and "location" not in r.headers
    assert "GET /v1/models" in r.json()["error"]["message"]


@pytest.mark.parametrize("path", ["/docs", "/redoc", "/openapi.json"])
def test_the_api_docs_are_off_by_default_and_on_with_docs(server, capped, path):
    r = httpx.get(f"{server.url}{path}")
    assert r.status_code == 404 and r.json()["error"]["type"] == "invalid_request_error"
    assert httpx.get(f"{capped.url}{path}").status_code == 200
    if path == "/openapi.json":
        assert "/v1/chat/completions" in httpx.get(f"{capped.url}{path}").json()["paths"]


def test_a_refused_cors_preflight_is_openai_json(capped):
    preflight = {"Access-Control-Request-Method": "POST"}
    r = httpx.options(f"{capped.url}/v1/completions",
                      headers={**preflight, "Origin": "https://evil.example"})
    assert r.status_code == 400 and r.headers["content-type"] == "application/json"
    error = r.json()["error"]
    assert error["code"] == "cors_refused" and "https://evil.example" in error["message"]
    assert "access-control-allow-origin" not in r.headers
    r = httpx.options(f"{capped.url}/v1/completions",
                      headers={**preflight, "Origin": "https://good.example"})
    assert r.status_code == 200
    assert r.headers["access-control-allow-origin"] == "https://good.example"


def test_requests_and_connections_past_their_caps_get_503(capped):
    body = json.dumps({"model": "tiny", "prompt": "a b", "max_tokens": 2}).encode()
    held = [connect(capped.url) for _ in range(2)]  # two requests in flight: bodies pending
    try:
        for sock in held:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\n"
                         b"Content-Length: %d\r\n\r\n" % len(body) + body[:5])
        third = connect(capped.url)
        held.append(third)
        third.sendall(b"GET /v1/models HTTP/1.1\r\nHost: localhost\r\n\r\n")
        reader = third.makefile("rb")
        held.append(reader)  # the socket closes when its reader does too
        status, headers, reply = read_response(reader)
        assert status == 503 and headers["retry-after"] == "1"
        assert json.loads(reply)["error"]["code"] == "server_overloaded"
        third.sendall(b"GET /health HTTP/1.1\r\nHost: localhost\r\n\r\n")  # always answers
        assert read_response(reader)[0] == 200
        with connect(capped.url) as fourth:  # past --max-connections 3
            data, _ = read_until_closed(fourth)
        assert error_of(data, 503)["code"] == "too_many_connections"
    finally:
        for sock in held:
            sock.close()
    t0 = time.time()  # the held requests end when their clients go: the caps free up
    while httpx.get(f"{capped.url}/v1/models").status_code != 200:
        assert time.time() - t0 < BOUND
        time.sleep(0.1)
    assert capped.metric("trt_spec:request_rejected_total", reason="overloaded") >= 1


def test_the_log_holds_no_traceback(server):
    """Every refusal above is the client's doing: warnings at most, never a server error."""
    text = server.log.read_text()
    assert "serving tiny" in text  # the log is the server's
    assert "Traceback" not in text and "ERROR" not in text, text[-2000:]
