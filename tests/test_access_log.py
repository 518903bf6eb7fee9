"""The access log (serve/request_log.py) and its format (serve/logs.py): a real `trt-spec
serve` process whose --log-format, --api-key and --max-num-seqs come from the environment,
its stderr read back as JSON lines. One line per request, written when the response has
ended, with the request's id (x-request-id, echoed; made where absent), its numbers as the
response reports them, and never the API key."""

import json
import logging
import os
import re
import time

import httpx
import pytest

from tests.server_util import start_server
from trt_spec.serve.logs import JsonFormatter, TextFormatter

KEY = "sk-test-7f3a9c1e5b"  # the server's API key: must appear in no log line
WRONG = "sk-wrong-0d8e2b6a4c"  # a key a client sent that is not the server's
EXTRA = {"ignore_eos": True}
FIELDS = {"request_id", "route", "status", "model", "method", "prompt_tokens", "cached_tokens",
          "completion_tokens", "ttft_s", "total_s", "tau", "finish_reason", "error",
          "error_param"}


@pytest.fixture(scope="module")
def server(tiny_spec_engine, tmp_path_factory):
    log = tmp_path_factory.mktemp("access") / "server.log"
    env = {**os.environ, "TRT_SPEC_LOG_FORMAT": "json", "TRT_SPEC_API_KEY": KEY,
           "TRT_SPEC_MAX_NUM_SEQS": "2"}
    with open(log, "w") as f:
        s = start_server(tiny_spec_engine, env=env, stderr=f)
    s.log = log
    s.headers = {"Authorization": f"Bearer {KEY}"}
    yield s
    assert s.stop() == 0
    assert KEY not in log.read_text() and WRONG not in log.read_text()


def access_lines(server) -> list[dict]:
    out = []
    for line in server.log.read_text().splitlines():
        if line.startswith("{"):
            entry = json.loads(line)  # every log line is one JSON object
            if entry["logger"] == "trt_spec.access":
                out.append(entry)
    return out


def line_of(server, request_id: str, timeout: float = 10) -> dict:
    """The access line of `request_id` (written as its response ends: wait for it)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        got = [e for e in access_lines(server) if e["request_id"] == request_id]
        if got:
            assert len(got) == 1, got
            return got[0]
        time.sleep(0.05)
    raise AssertionError(f"no access line for {request_id!r}: {access_lines(server)[-3:]}")


def chat(server, stream=False, headers=None, **body):
    body = {"model": "tiny", "messages": [{"role": "user", "content": "a b c d"}],
            "max_tokens": 8, "temperature": 0, "speculative": {"method": "vanilla"},
            **EXTRA, "stream": stream, **body}
    return httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60,
                      headers={**server.headers, **(headers or {})})


def test_a_chat_requests_line_carries_its_numbers(server):
    r = chat(server, headers={"x-request-id": "client-id-1"})
    assert r.status_code == 200 and r.headers["x-request-id"] == "client-id-1"
    body = r.json()
    entry = line_of(server, "client-id-1")
    assert FIELDS <= set(entry) and entry["level"] == "INFO"
    assert entry["message"] == "POST /v1/chat/completions 200"
    assert (entry["route"], entry["status"], entry["model"], entry["method"]) == \
        ("POST /v1/chat/completions", 200, "tiny", "vanilla")
    usage = body["usage"]
    assert (entry["prompt_tokens"], entry["cached_tokens"], entry["completion_tokens"]) == \
        (usage["prompt_tokens"], usage["prompt_tokens_details"]["cached_tokens"], 8)
    assert entry["tau"] == pytest.approx(body["metrics"]["tau"], abs=1e-4) and entry["tau"] >= 1
    assert entry["ttft_s"] == pytest.approx(body["metrics"]["time_to_first_token_s"], abs=1e-5)
    assert 0 < entry["ttft_s"] <= entry["total_s"]
    assert (entry["finish_reason"], entry["error"]) == ("length", None)


def test_a_streamed_requests_line_is_written_when_the_stream_ends(server):
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", headers=server.headers,
                      timeout=60, json={"model": "tiny", "stream": True, "max_tokens": 6,
                                        "messages": [{"role": "user", "content": "x y"}],
                                        "speculative": {"method": "ngram"}, **EXTRA}) as r:
        rid = r.headers["x-request-id"]  # none sent: one made, 32 hex digits
        assert re.fullmatch(r"[0-9a-f]{32}", rid)
        events = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]"
    entry = line_of(server, rid)
    assert (entry["status"], entry["method"], entry["completion_tokens"],
            entry["finish_reason"]) == (200, "ngram", 6, "length")
    last = json.loads(events[-2].removeprefix("data: "))  # the last choice's chunk carries the metrics
    assert entry["tau"] == pytest.approx(last["metrics"]["tau"], abs=1e-4)


@pytest.mark.parametrize("given", ["has space", "x" * 129, "naïve"])
def test_an_unusable_request_id_is_replaced(server, given):
    r = httpx.get(f"{server.url}/v1/models", headers={**server.headers,
                                                     "x-request-id": given.encode()})
    assert r.status_code == 200
    rid = r.headers["x-request-id"]
    assert rid != given and re.fullmatch(r"[0-9a-f]{32}", rid)
    assert line_of(server, rid)["route"] == "GET /v1/models"


def test_errors_are_logged_with_their_status_and_code(server):
    r = chat(server, headers={"x-request-id": "err-model"}, model="nope")
    assert r.status_code == 404 and r.headers["x-request-id"] == "err-model"
    entry = line_of(server, "err-model")
    assert (entry["status"], entry["error"], entry["model"], entry["completion_tokens"]) == \
        (404, "model_not_found", "nope", None)
    r = chat(server, headers={"x-request-id": "err-field"}, max_tokens=-1)
    assert r.status_code == 400
    entry = line_of(server, "err-field")
    assert (entry["status"], entry["error"], entry["error_param"]) == \
        (400, "invalid_request_error", "max_tokens")
    r = chat(server, headers={"x-request-id": "err-key", "Authorization": f"Bearer {WRONG}"})
    assert r.status_code == 401 and r.headers["x-request-id"] == "err-key"
    entry = line_of(server, "err-key")
    assert (entry["status"], entry["error"]) == (401, "invalid_api_key")
    r = httpx.get(f"{server.url}/nowhere?api_key={KEY}",
                  headers={**server.headers, "x-request-id": "err-404"})
    assert r.status_code == 404
    entry = line_of(server, "err-404")
    assert (entry["route"], entry["error"]) == ("GET /nowhere", "invalid_request_error")
    r = httpx.get(f"{server.url}/a%0Ab", headers={**server.headers,
                                                  "x-request-id": "err-newline"})
    assert r.status_code == 404
    assert line_of(server, "err-newline")["route"] == "GET /a\\nb"  # escaped: one line


def test_the_api_key_is_in_no_log_line(server):
    """Sent right and wrong, in headers and a query string: the key is in no line (the
    module's fixture checks the whole log again once the server has stopped)."""
    chat(server)
    chat(server, headers={"Authorization": f"Bearer {WRONG}"})
    httpx.get(f"{server.url}/health?key={KEY}")
    assert len(access_lines(server)) >= 3
    text = server.log.read_text()
    assert KEY not in text and WRONG not in text


def test_the_text_format_keeps_a_line_one_line():
    """A value with spaces or control characters (a path with an encoded newline) is
    JSON-quoted; floats are short; None is left out."""
    record = logging.LogRecord("trt_spec.access", logging.INFO, __file__, 1, "%s %s",
                               ("GET /a", 404), None)
    record.fields = {"request_id": "r-1", "route": "GET /a\nb", "status": 404,
                     "total_s": 0.0123456, "model": None}
    line = TextFormatter().format(record)
    assert "\n" not in line and line.endswith(
        ' request_id=r-1 route="GET /a\\nb" status=404 total_s=0.01235')
    data = json.loads(JsonFormatter().format(record))
    assert (data["route"], data["model"], data["logger"]) == ("GET /a\nb", None,
                                                               "trt_spec.access")
