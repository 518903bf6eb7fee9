"""What no request may do to `trt-spec serve`: a body past the limit, JSON nested past the
parser, a negative seed, coerced types, a prompt far past the context, a prompt that takes
long to tokenize. Each is answered 4xx with OpenAI's error JSON, counted in /metrics, and the
server keeps serving. And logprobs, read by the official openai client."""

import json
import threading
import time

import httpx
import numpy as np
import openai
import pytest

from tests.server_util import start_server
from trt_spec import LLM, SamplingParams
from trt_spec.runtime.tokenizer import Tokenizer

GOOD = {"model": "tiny", "prompt": "a b", "max_tokens": 3}
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "a b"}], "max_tokens": 3}


@pytest.fixture(scope="module")
def server(tiny_spec_engine):
    s = start_server(tiny_spec_engine, "--max-num-seqs", "2", "--max-body-bytes", "200000")
    yield s
    assert s.stop() == 0


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


HOSTILE = [  # (path, raw body, status, param, message)
    ("completions", json.dumps({**GOOD, "prompt": "a " * 120000}).encode(), 413, None,
     "the request body is larger than 200000 bytes"),
    ("completions", json.dumps({**GOOD, "seed": -1}).encode(), 400, "seed",
     "seed=-1: must be an integer in 0..18446744073709551615"),
    ("chat/completions", json.dumps({**CHAT, "seed": 2**64}).encode(), 400, "seed",
     "seed=18446744073709551616: must be an integer in 0.."),
    ("completions", b'{"model": "tiny", "prompt": ' + b"[" * 1200 + b"]" * 1200 + b"}", 400,
     None, "nests JSON"),
    ("completions", b"[" * 100000, 400, None, "nests JSON too deeply"),
    ("completions", json.dumps({**GOOD, "max_tokens": True}).encode(), 400, "max_tokens",
     "max_tokens: Input should be a valid integer"),
    ("completions", json.dumps({**GOOD, "stream": "yes"}).encode(), 400, "stream",
     "stream: Input should be a valid boolean"),
    ("chat/completions", json.dumps({**CHAT, "temperature": "1"}).encode(), 400, "temperature",
     "temperature: Input should be a valid number"),
    ("chat/completions", json.dumps({**CHAT, "top_logprobs": 21, "logprobs": True}).encode(),
     400, "top_logprobs", "top_logprobs=21: must be an integer in 0..20"),
    ("chat/completions", json.dumps({**CHAT, "top_logprobs": 2}).encode(), 400,
     "top_logprobs", "top_logprobs=2: needs logprobs: true"),
    ("completions", json.dumps({**GOOD, "logprobs": True}).encode(), 400, "logprobs",
     "logprobs=true: on /v1/completions logprobs is the number of alternatives"),
    ("completions", json.dumps({**GOOD, "stream_options": {"include_usage": True}}).encode(),
     400, "stream_options", "stream_options is only allowed with stream: true"),
    ("chat/completions", json.dumps({**CHAT, "messages": [{"role": "user", "content": None}]})
     .encode(), 400, "messages[0].content", "messages[0].content=None: expected a string"),
    ("completions", json.dumps({**GOOD, "prompt": "word " * 30000}).encode(), 400, "prompt",
     "the prompt has at least"),
    ("completions", b'{"model": "tiny", "prompt": "a", "max_tokens": ' + b"9" * 5000 + b"}",
     400, "max_tokens", "max_tokens=an integer of 5000 digits: past int64"),
    ("completions", json.dumps({**GOOD, "prompt": [5, -1], "echo": True}).encode(), 400,
     "prompt", "prompt token ids [-1] are outside"),
    ("chat/completions", json.dumps({**CHAT, "chat_template_kwargs": {"self": 1}}).encode(),
     400, "chat_template_kwargs", "chat_template_kwargs sets self"),
]


@pytest.mark.parametrize("path, body, status, param, message", HOSTILE,
                         ids=[h[4][:30] for h in HOSTILE])
def test_hostile_requests_get_openai_errors_and_are_counted(server, path, body, status,
                                                            param, message):
    before = server.metric("trt_spec:request_rejected_total", reason="invalid")
    r = httpx.post(f"{server.url}/v1/{path}", content=body,
                   headers={"Content-Type": "application/json"}, timeout=30)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert message in error["message"], error["message"]
    assert error["type"] == "invalid_request_error" and error["param"] == param
    assert server.metric("trt_spec:request_rejected_total", reason="invalid") == before + 1
    assert httpx.post(f"{server.url}/v1/completions", json=GOOD).status_code == 200


def test_body_limit_without_content_length(server):
    def chunks():
        for _ in range(30):
            yield b" " * 10000  # 300 kB of whitespace, sent chunked
    r = httpx.post(f"{server.url}/v1/completions", content=chunks(),
                   headers={"Content-Type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"


def test_logprobs_false_is_accepted(client):
    r = client.chat.completions.create(model="tiny", messages=CHAT["messages"], max_tokens=3,
                                       logprobs=False)
    assert r.choices[0].logprobs is None
    r = httpx.post(f"{client.base_url}completions", json={**GOOD, "logprobs": False})
    assert r.status_code == 200 and r.json()["choices"][0]["logprobs"] is None


def test_openai_client_reads_logprobs(client, tiny_spec_engine):
    """Chat and completions, streamed and not, with and without speculation: the same
    tokens, the same logprobs, equal to the Python API's (the target's log-softmax)."""
    want = LLM(tiny_spec_engine, max_model_len=256).generate(
        [CHAT["messages"]], SamplingParams(max_tokens=10, ignore_eos=True, logprobs=2))[0]
    chat_kw = dict(model="tiny", messages=CHAT["messages"], max_tokens=10, temperature=0,
                   logprobs=True, top_logprobs=2)
    for spec in (None, {"method": "vanilla", "num_draft_tokens": 3}):
        extra = {"ignore_eos": True, **({"speculative": spec} if spec else {})}
        full = client.chat.completions.create(**chat_kw, extra_body=extra)
        content = full.choices[0].logprobs.content
        assert [c.logprob for c in content] == [lp.logprob for lp in want.logprobs]
        assert [[t.logprob for t in c.top_logprobs] for c in content] == \
            [[v for _, v in lp.top] for lp in want.logprobs]
        # (the tiny word-level tokenizer's decode puts spaces between its tokens)
        assert "".join(bytes(c.bytes).decode() for c in content) == \
            full.choices[0].message.content.replace(" ", "")
        streamed = [c for chunk in client.chat.completions.create(**chat_kw, extra_body=extra,
                                                                  stream=True)
                    if chunk.choices and chunk.choices[0].logprobs
                    for c in chunk.choices[0].logprobs.content]
        assert [c.model_dump() for c in streamed] == [c.model_dump() for c in content]
    text_kw = dict(model="tiny", prompt="d e f", max_tokens=8, temperature=0, logprobs=3,
                   extra_body={"ignore_eos": True})
    full = client.completions.create(**text_kw)
    lp = full.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 8
    assert all(len(t) == 3 and max(t.values()) == v
               for t, v in zip(lp.top_logprobs, lp.token_logprobs))  # greedy: the top one
    assert all(v <= 0 for v in lp.token_logprobs)
    chunks = list(client.completions.create(**text_kw, stream=True))
    assert [v for c in chunks for v in c.choices[0].logprobs.token_logprobs] == \
        lp.token_logprobs
    assert [o for c in chunks for o in c.choices[0].logprobs.text_offset] == lp.text_offset


def test_metrics_count_every_error_and_nothing_is_5xx(server):
    bodies = [b"", b"{", b"null", b'"x"', b"1e999", b'{"model": "tiny", "prompt": 1e999}',
              b'{"model": "tiny", "prompt": "a", "max_tokens": 1e999}',
              b'{"model": "tiny", "prompt": "a", "stop": {"x": 1}}',
              b'{"model": "tiny", "prompt": "a", "seed": "1"}',
              b'{"model": "tiny", "prompt": "a", "speculative": {"method": ["x"]}}',
              b'{"model": "tiny", "prompt": "a", "speculative": {"num_draft_tokens": true}}',
              b'{"model": "tiny", "prompt": [true, false]}',
              b'{"model": "tiny", "messages": {"role": "user"}}',
              b'{"model": "tiny", "messages": [{"role": "user", "content": "a", "x": 1}]}',
              b'{"model": "tiny", "messages": [{"role": "user", "content": [{"type": "image"}]}]}']
    before = server.metric("trt_spec:request_rejected_total", reason="invalid")
    for body in bodies:
        for path in ("completions", "chat/completions"):
            r = httpx.post(f"{server.url}/v1/{path}", content=body)
            assert 400 <= r.status_code < 500, (body, r.text)
            assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    after = server.metric("trt_spec:request_rejected_total", reason="invalid")
    assert after - before == 2 * len(bodies)
    assert server.metric("trt_spec:request_rejected_total", reason="error") == 0


def test_tokenizing_a_long_prompt_releases_the_gil(tiny_engine):
    """The server tokenizes on a worker thread; that only helps if the tokenizer lets the
    event loop run meanwhile."""
    tok = Tokenizer(tiny_engine)
    text = "a b c d " * 400000
    gaps, done = [], threading.Event()

    def ticker():
        while not done.is_set():
            t0 = time.perf_counter()
            time.sleep(0.005)
            gaps.append(time.perf_counter() - t0)

    t = threading.Thread(target=ticker)
    t.start()
    t0 = time.perf_counter()
    ids = tok.encode(text, add_special_tokens=False)
    took = time.perf_counter() - t0
    done.set()
    t.join()
    assert len(ids) == 1600000 and took > 0.1
    assert max(gaps) < took / 3, (max(gaps), took)


def test_seed_and_types_are_checked_by_the_python_api_too(tiny_spec_engine):
    llm = LLM(tiny_spec_engine)
    for kwargs, field in [(dict(seed=-1), "seed"), (dict(temperature="hot"), "temperature"),
                          (dict(stop=None), "stop"), (dict(temperature=float("inf")),
                                                      "temperature"),
                          (dict(max_tokens=True), "max_tokens"), (dict(top_k=1.5), "top_k"),
                          (dict(logprobs=21), "logprobs"), (dict(ignore_eos="yes"),
                                                            "ignore_eos")]:
        with pytest.raises(ValueError, match=f"^{field}=") as e:
            SamplingParams(**kwargs)
        assert e.value.field == field
    for prompt, message in [([{"role": "robot", "content": "x"}],
                             r"messages\[0\].role='robot': must be one of system, developer"),
                            ([[]], r"messages=\[\]: expected a non-empty list"),
                            ([[{"role": "user"}]], r"messages\[0\]=.*expected"),
                            ([], "prompts is empty")]:
        with pytest.raises(ValueError, match=message):
            llm.generate(prompt, SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="expected a SamplingParams .got dict"):
        llm.generate("a", {"max_tokens": 2})
    with pytest.raises(ValueError, match="num_draft_tokens=True"):
        llm.generate("a", SamplingParams(max_tokens=2), method="vanilla", num_draft_tokens=True)
    assert not llm.scheduler.has_work()
    assert np.isfinite(llm.generate("a", SamplingParams(max_tokens=2, seed=7,
                                                        temperature=1))[0].token_ids).all()
