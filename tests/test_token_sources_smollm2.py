"""`token_sources` through `trt-spec serve` on SmolLM2 int4: each token's origin, whole and
streamed alike; the texts join to the answer; the counts agree with the usage and metrics;
and a request that does not ask sees the responses it always saw."""

import json

import httpx
import pytest

from tests.server_util import start_server

pytestmark = pytest.mark.slow

REPEAT = [{"role": "user", "content": "Repeat this sentence three times, one per line: "
                                      "The quick brown fox jumps over the lazy dog."}]


@pytest.fixture(scope="module")
def server(smollm2_int4_spec_engine):
    s = start_server(smollm2_int4_spec_engine, "--max-num-seqs", "2", model="smollm2")
    yield s
    assert s.stop() == 0


def post(server, stream=False, **body):
    body = {"model": "smollm2", "messages": REPEAT, "max_tokens": 48, "temperature": 0,
            **body}
    if not stream:
        r = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        return r.json()
    with httpx.stream("POST", f"{server.url}/v1/chat/completions",
                      json={**body, "stream": True}, timeout=120) as r:
        lines = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    return [json.loads(x) for x in lines if x != "[DONE]"]


def test_sources_add_up_whole_and_streamed(server):
    for method in ("none", "ngram", "hybrid"):
        spec = {"speculative": {"method": method}, "token_sources": True, "ignore_eos": True}
        whole = post(server, **spec)
        choice, metrics = whole["choices"][0], whole["metrics"]
        entries = choice["token_sources"]
        assert "".join(e["text"] for e in entries) == choice["message"]["content"]
        assert len(entries) == whole["usage"]["completion_tokens"] == 48
        drafted = [e for e in entries if e["source"] != "target"]
        assert len(drafted) == metrics["accepted_tokens"], method
        assert all(bytes(e["bytes"]).decode("utf-8", "replace") == e["text"]
                   for e in entries if e["text"] and e["text"].isascii())
        if method == "none":
            assert not drafted
        else:
            assert {e["source"] for e in drafted} <= {"lookup", "corpus", "head"}
            assert drafted, method  # the repeated sentence is drafted
        chunks = post(server, stream=True, **spec)
        streamed = [e for c in chunks for ch in c["choices"]
                    for e in ch.get("token_sources") or []]
        # the same tokens (the policy's k follows what it measured: the origins may differ)
        assert [(e["id"], e["text"]) for e in streamed] == \
            [(e["id"], e["text"]) for e in entries], method
        final = [c["metrics"] for c in chunks if "metrics" in c][0]
        assert sum(e["source"] != "target" for e in streamed) == final["accepted_tokens"]
        content = "".join(ch["delta"].get("content") or "" for c in chunks
                          for ch in c["choices"])
        assert content == choice["message"]["content"]


def test_the_end_of_turn_token_carries_no_text(server):
    whole = post(server, max_tokens=200, token_sources=True)
    entries = whole["choices"][0]["token_sources"]
    assert whole["choices"][0]["finish_reason"] == "stop"
    assert entries[-1]["text"] == "" and entries[-1]["bytes"]  # <|im_end|>
    assert "".join(e["text"] for e in entries) == whole["choices"][0]["message"]["content"]


def test_grammar_forced_tokens_are_marked(server):
    schema = {"type": "object", "properties": {"name": {"type": "string"},
                                               "age": {"type": "integer"}},
              "required": ["name", "age"], "additionalProperties": False}
    whole = post(server, token_sources=True, max_tokens=64,
                 response_format={"type": "json_schema",
                                  "json_schema": {"name": "p", "schema": schema}})
    entries = whole["choices"][0]["token_sources"]
    json.loads("".join(e["text"] for e in entries))
    assert any(e["source"] == "grammar" and e["drafter"] == "grammar" for e in entries)


def test_a_request_that_does_not_ask_sees_no_sources(server):
    whole = post(server, speculative={"method": "ngram"})
    assert "token_sources" not in whole["choices"][0]
    chunks = post(server, stream=True, speculative={"method": "ngram"})
    assert not any("token_sources" in ch for c in chunks for ch in c["choices"])
    r = httpx.post(f"{server.url}/v1/chat/completions", timeout=60, json={
        "model": "smollm2", "messages": REPEAT, "token_sources": "yes"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "token_sources"
