"""Server behaviour that needs time to pass: a disconnecting client frees its KV slot, the
bounded queue answers 429, SIGTERM lets in-flight requests finish. The server sleeps 50 ms
after each step (--debug-step-delay: a slower model), so a 200-token request runs ~10 s and
cannot finish by itself while a test looks at it."""

import json
import signal
import time

import httpx
import openai
import pytest

from tests.server_util import start_server

DELAY = "0.05"


@pytest.fixture(scope="module")
def server(tiny_engine):
    s = start_server(tiny_engine, "--max-num-seqs", "2", "--max-waiting", "2",
                     "--debug-step-delay", DELAY)
    yield s
    assert s.stop() == 0


def chat(max_tokens: int, stream: bool = True) -> dict:
    return {"model": "tiny", "messages": [{"role": "user", "content": "a b c"}],
            "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": stream}


def events(response):
    """Parsed SSE events of a streaming response (the string "[DONE]" last)."""
    for line in response.iter_lines():
        if line.startswith("data: "):
            yield "[DONE]" if line == "data: [DONE]" else json.loads(line[6:])


def wait_for(condition, timeout: float = 10.0) -> bool:
    t0 = time.time()
    while time.time() - t0 < timeout:
        if condition():
            return True
        time.sleep(0.05)
    return False


def test_disconnect_mid_stream_frees_the_slot(server):
    aborted = server.metric("trt_spec:request_success_total", finished_reason="abort")
    finished = server.metric("trt_spec:request_success_total", finished_reason="length")
    with httpx.Client(timeout=30) as c:
        with c.stream("POST", f"{server.url}/v1/chat/completions", json=chat(200)) as r:
            reader, contents = events(r), 0  # dropping the reader would close the connection
            while contents < 2:
                contents += bool(next(reader)["choices"][0]["delta"].get("content"))
            assert server.metric("trt_spec:kv_cache_slots_used") == 1
    # the connection is closed: the request is cancelled and its slot freed
    assert wait_for(lambda: server.metric("trt_spec:kv_cache_slots_used") == 0)
    assert server.metric("trt_spec:request_success_total", finished_reason="abort") == aborted + 1
    assert server.metric("trt_spec:request_success_total", finished_reason="length") == finished


def test_disconnect_while_waiting_for_a_full_response(server):
    aborted = server.metric("trt_spec:request_success_total", finished_reason="abort")
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}/v1/chat/completions", json=chat(200, stream=False),
                   timeout=httpx.Timeout(30, read=1.0))
    assert wait_for(lambda: server.metric("trt_spec:kv_cache_slots_used") == 0)
    assert server.metric("trt_spec:request_success_total", finished_reason="abort") == aborted + 1


def test_queue_bound_answers_429_then_recovers(server):
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    with httpx.Client(timeout=30) as c:
        # 2 running (2 slots), then 2 waiting (the bound)
        streams, readers = [], []  # a dropped reader would close its connection
        for gauge in ("num_requests_running", "num_requests_waiting"):
            for _ in range(2):
                streams.append(c.stream("POST", f"{server.url}/v1/chat/completions",
                                        json=chat(200)))
                r = streams[-1].__enter__()
                assert r.status_code == 200, (r.status_code, r.read())
                readers.append(events(r))
                assert next(readers[-1])["choices"][0]["delta"]["role"] == "assistant"
            assert wait_for(lambda: server.metric(f"trt_spec:{gauge}") == 2)
        r = c.post(f"{server.url}/v1/chat/completions", json=chat(5, stream=False))
        assert r.status_code == 429 and r.headers["retry-after"] == "1"
        assert r.json()["error"]["message"] == ("the server is busy: 2 requests are already "
                                                "waiting (the bound is 2); retry later")
        assert r.json()["error"]["type"] == "rate_limit_exceeded"
        with pytest.raises(openai.RateLimitError, match="the server is busy"):
            client.completions.create(model="tiny", prompt="a", max_tokens=2)
        assert server.metric("trt_spec:request_rejected_total", reason="queue_full") >= 2
        for s in streams:
            s.__exit__(None, None, None)
    assert wait_for(lambda: server.metric("trt_spec:kv_cache_slots_used") == 0
                    and server.metric("trt_spec:num_requests_waiting") == 0)
    ok = client.completions.create(model="tiny", prompt="a b", max_tokens=4,
                                   extra_body={"ignore_eos": True})
    assert ok.usage.completion_tokens == 4


def test_sigterm_lets_in_flight_requests_finish(tiny_engine):
    s = start_server(tiny_engine, "--debug-step-delay", DELAY)
    try:
        with httpx.Client(timeout=30) as c:
            body = {**chat(30), "stream_options": {"include_usage": True}}
            with c.stream("POST", f"{s.url}/v1/chat/completions", json=body) as r:
                it = events(r)
                assert next(it)["choices"][0]["delta"]["role"] == "assistant"
                s.proc.send_signal(signal.SIGTERM)
                # no new connections once shutdown began ...
                assert wait_for(lambda: refused(s.url), timeout=5)
                # ... while the request in flight runs to its end
                rest = list(it)
        assert rest[-1] == "[DONE]"
        assert rest[-3]["choices"][0]["finish_reason"] == "length"
        assert rest[-2]["choices"] == [] and rest[-2]["usage"]["completion_tokens"] == 30
        assert s.proc.wait(20) == 0
    finally:
        s.stop()


def test_streams_cut_past_the_shutdown_timeout_end_cleanly(tiny_engine, tmp_path):
    """Past --shutdown-timeout each stream still open gets an error event and [DONE], a
    full response a 503, and the log holds no traceback."""
    log = open(tmp_path / "server.log", "w")
    s = start_server(tiny_engine, "--debug-step-delay", "0.1", "--shutdown-timeout", "1",
                     stderr=log)
    try:
        with httpx.Client(timeout=30) as c:
            with c.stream("POST", f"{s.url}/v1/chat/completions", json=chat(200)) as r:
                it = events(r)
                assert next(it)["choices"][0]["delta"]["role"] == "assistant"
                s.proc.send_signal(signal.SIGTERM)
                rest = list(it)
        assert rest[-1] == "[DONE]"
        error = rest[-2]["error"]
        assert error["code"] == "abort" and "--shutdown-timeout" in error["message"]
        assert all("choices" in e for e in rest[:-2])  # tokens came until the cut
        assert s.proc.wait(20) == 0
    finally:
        s.stop()
        log.close()
    text = (tmp_path / "server.log").read_text()
    assert "Traceback" not in text and "CancelledError" not in text, text


def refused(url: str) -> bool:
    """True when a new connection is not served: refused, or (a connection the kernel queued
    just before the listener closed) reset without a response. A slow answer is no answer
    yet (False: ask again)."""
    try:
        httpx.get(f"{url}/health", timeout=1)
        return False
    except (httpx.ConnectError, httpx.ReadError, httpx.RemoteProtocolError):
        return True
    except httpx.TimeoutException:
        return False
