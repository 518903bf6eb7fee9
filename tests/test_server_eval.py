"""What evaluation harnesses and operators need from `trt-spec serve`: /v1/completions with a
list of prompts (strings or token ids, mixed lengths), echo with each prompt token's logprobs
(equal to a teacher-forced pass of the same engine at the same prefill chunking), max_tokens
0, vLLM's prompt_logprobs; the tokenizer routes; fields accepted and ignored; the API key
(401s counted) and CORS."""

import json

import httpx
import numpy as np
import openai
import pytest

from tests.server_util import start_server
from trt_spec import LLM, SamplingParams
from trt_spec.runtime.generator import Generator
from trt_spec.runtime.sampling import log_softmax
from trt_spec.tools.fidelity import score

KEY = "sk-test-0123456789"
AUTH = {"Authorization": f"Bearer {KEY}"}
CHUNK = 8  # --max-prefill-tokens: the prompts below are read in several chunks
ORIGIN = "http://good.example"
# prompts of mixed lengths, as token ids (the tiny vocabulary: 5..127 are words)
RNG = np.random.default_rng(0)
PROMPTS = [[int(t) for t in RNG.integers(5, 128, n)] for n in (3, 21, 9, 40)]


@pytest.fixture(scope="module")
def server(tiny_spec_engine):
    s = start_server(tiny_spec_engine, "--max-num-seqs", "4", "--max-waiting", "16",
                     "--max-prefill-tokens", str(CHUNK), "--api-key", KEY,
                     "--allowed-origins", f"{ORIGIN},http://other.example")
    yield s
    assert s.stop() == 0


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0)


@pytest.fixture(scope="module")
def teacher(tiny_spec_engine):
    """The same engine in this process: fidelity's teacher-forced scores."""
    gen = Generator(tiny_spec_engine, threads=1)

    def logprobs(ids: list[int]) -> np.ndarray:  # [len(ids) - 1]: each token after the first
        lp = log_softmax(score(gen, ids, 1, chunk=CHUNK))
        return lp[np.arange(len(ids) - 1), ids[1:]]
    return logprobs


def post(server, path, body, headers=AUTH):
    return httpx.post(f"{server.url}{path}", json=body, headers=headers, timeout=60)


@pytest.mark.parametrize("max_tokens", [0, 1])
def test_echo_logprobs_equal_teacher_forcing(server, teacher, max_tokens):
    """lm-evaluation-harness's loglikelihood request: a list of token-id prompts of mixed
    lengths, echo, logprobs 1, max_tokens 0 or 1; one choice per prompt, in order."""
    r = post(server, "/v1/completions", {
        "model": "tiny", "prompt": PROMPTS, "echo": True, "logprobs": 1,
        "max_tokens": max_tokens, "temperature": 0, "seed": 1234})
    assert r.status_code == 200, r.text
    body = r.json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    assert body["usage"]["prompt_tokens"] == sum(map(len, PROMPTS))
    assert body["usage"]["completion_tokens"] == max_tokens * len(PROMPTS)
    for ids, choice in zip(PROMPTS, body["choices"]):
        lp = choice["logprobs"]
        assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(ids) + max_tokens
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        want = teacher(ids)
        np.testing.assert_allclose(lp["token_logprobs"][1:len(ids)], want, atol=1e-4, rtol=0)
        assert all(len(top) == 1 for top in lp["top_logprobs"][1:])
        # text offsets count the echoed tokens' text
        assert lp["text_offset"][0] == 0
        assert all(b - a == len(t) for a, b, t in zip(lp["text_offset"], lp["text_offset"][1:],
                                                     lp["tokens"]))
        assert choice["finish_reason"] == "length"
    # lm-evaluation-harness reads it as it reads OpenAI's
    lm_eval = pytest.importorskip("lm_eval.models.openai_completions")
    parsed = lm_eval.LocalCompletionsAPI.parse_logprobs(body, ctxlens=[1, 5, 4, 30])
    cut = -1 if max_tokens else None  # the harness drops the generated token (max_tokens 1)
    assert len(parsed) == 4 and all(isinstance(g, bool) for _, g in parsed)
    if not max_tokens:  # with nothing generated, [ctxlen:-1] leaves the prompt's last out
        return
    for (total, _), ids, choice, ctx in zip(parsed, PROMPTS, body["choices"], [1, 5, 4, 30]):
        assert total == pytest.approx(sum(choice["logprobs"]["token_logprobs"][ctx:cut]))


def test_echo_text_and_string_prompts(server, client):
    """Strings in a list: each echoed in front of its completion; the completion is the one
    a lone request gets."""
    prompts = ["a b c", "d e f g h i j k l m n o p"]
    out = client.completions.create(model="tiny", prompt=prompts, max_tokens=4, temperature=0,
                                    echo=True, extra_body={"ignore_eos": True})
    alone = [client.completions.create(model="tiny", prompt=p, max_tokens=4, temperature=0,
                                       extra_body={"ignore_eos": True}).choices[0].text
             for p in prompts]
    assert [c.index for c in out.choices] == [0, 1]
    assert [c.text for c in out.choices] == [p + t for p, t in zip(prompts, alone)]
    streamed = list(client.completions.create(model="tiny", prompt=prompts, max_tokens=4,
                                              temperature=0, echo=True, stream=True,
                                              extra_body={"ignore_eos": True}))
    texts = ["", ""]
    for chunk in streamed:
        for c in chunk.choices:
            texts[c.index] += c.text
    assert texts == [c.text for c in out.choices]


def test_max_tokens_0_reads_the_prompt_only(server, client):
    out = client.completions.create(model="tiny", prompt="a b c d", max_tokens=0, echo=True)
    assert out.choices[0].text == "a b c d" and out.choices[0].finish_reason == "length"
    assert out.usage.completion_tokens == 0
    plain = client.completions.create(model="tiny", prompt="a b c d", max_tokens=0)
    assert plain.choices[0].text == ""


def test_prompt_logprobs_on_both_routes(server, teacher, tiny_spec_engine):
    """vLLM's prompt_logprobs: per prompt token None (the first) or {id: {logprob, rank,
    decoded_token}} with its alternatives; completions per choice, chat beside choices; the
    Python API's RequestOutput.prompt_logprobs hold the same numbers."""
    ids = PROMPTS[1]
    r = post(server, "/v1/completions", {"model": "tiny", "prompt": ids, "max_tokens": 1,
                                         "prompt_logprobs": 2, "temperature": 0})
    got = r.json()["choices"][0]["prompt_logprobs"]
    assert got[0] is None and len(got) == len(ids)
    own = [entry[str(t)] for entry, t in zip(got[1:], ids[1:])]
    np.testing.assert_allclose([e["logprob"] for e in own], teacher(ids), atol=1e-4, rtol=0)
    for entry in got[1:]:
        ranks = sorted(e["rank"] for e in entry.values())
        assert ranks[:2] == [1, 2] and len(entry) in (2, 3)
    chat = post(server, "/v1/chat/completions", {
        "model": "tiny", "messages": [{"role": "user", "content": "a b"}], "max_tokens": 1,
        "prompt_logprobs": 0}).json()
    assert chat["prompt_logprobs"][0] is None
    assert len(chat["prompt_logprobs"]) == chat["usage"]["prompt_tokens"]
    assert all(len(e) == 1 for e in chat["prompt_logprobs"][1:])
    refused = post(server, "/v1/chat/completions", {
        "model": "tiny", "messages": [{"role": "user", "content": "a"}], "stream": True,
        "prompt_logprobs": 1})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "prompt_logprobs"
    llm = LLM(tiny_spec_engine, max_prefill_tokens=CHUNK, threads=1)
    out = llm.generate([llm.tokenizer.decode(ids)], SamplingParams(max_tokens=0,
                                                                   prompt_logprobs=1),
                       chat=False)[0]
    assert out.prompt_token_ids == ids and out.token_ids == []
    np.testing.assert_allclose([lp.logprob for lp in out.prompt_logprobs[1:]], teacher(ids),
                               atol=1e-4, rtol=0)


BAD_PROMPTS = [  # (prompt, message)
    ([], "expected a string, a list of strings, a list of token ids, or a list of token-id"),
    (["a", 5], "expected a string, a list of strings"),
    ([[5, 6], []], "prompt[1] is empty"),
    ([[5, 6], [7, True]], "prompt[1] holds true: a token-id list holds integers only"),
    ([[5, 6], [7, 999]], "prompt[1]: prompt token ids [999] are outside 0..127"),
    (["a"] * 129, "prompt holds 129 prompts; at most 128 are allowed per request"),
    (["a"] * 17, "prompt holds 17 prompts; this server queues at most 16 requests"),
]


@pytest.mark.parametrize("prompt, message", BAD_PROMPTS, ids=[m[:24] for _, m in BAD_PROMPTS])
def test_bad_prompt_lists_get_400(server, prompt, message):
    r = post(server, "/v1/completions", {"model": "tiny", "prompt": prompt, "max_tokens": 1})
    assert r.status_code == 400, r.text
    assert message in r.json()["error"]["message"] and r.json()["error"]["param"] == "prompt"


def test_ignored_fields_are_accepted_unknown_ones_refused(server):
    body = {"model": "tiny", "prompt": "a b", "max_tokens": 2, "user": "u1",
            "metadata": {"run": "7"}, "store": False, "service_tier": "auto",
            "prompt_cache_key": "k", "safety_identifier": "s"}
    assert post(server, "/v1/completions", body).status_code == 200
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "a"}], "max_tokens": 2,
            "store": True, "metadata": {"a": "b"}}
    assert post(server, "/v1/chat/completions", chat).status_code == 200
    r = post(server, "/v1/completions", {**body, "suffix": "x"})
    assert r.status_code == 400 and "unknown field 'suffix'" in r.json()["error"]["message"]


def test_tokenizer_routes(server, tiny_spec_engine):
    from trt_spec.runtime.tokenizer import Tokenizer

    tok = Tokenizer(tiny_spec_engine)
    r = post(server, "/tokenize", {"model": "tiny", "prompt": "a b c", "return_token_strs": True})
    assert r.json() == {"count": 3, "max_model_len": 256, "tokens": tok.encode("a b c"),
                        "token_strs": ["a", "b", "c"]}
    chat = post(server, "/tokenize", {"messages": [{"role": "user", "content": "a"}]}).json()
    assert chat["tokens"] == tok.encode_chat([{"role": "user", "content": "a"}])
    assert chat["token_strs"] is None
    bare = post(server, "/tokenize", {"messages": [{"role": "user", "content": "a"}],
                                      "add_generation_prompt": False}).json()
    assert bare["count"] < chat["count"]
    assert post(server, "/detokenize", {"tokens": tok.encode("a b c")}).json() == \
        {"prompt": "a b c"}
    bad = post(server, "/detokenize", {"tokens": [5, 500]})
    assert bad.status_code == 400 and "tokens [500] are outside 0..127" in bad.text
    both = post(server, "/tokenize", {"prompt": "a", "messages": []})
    assert both.status_code == 400 and "give one of prompt" in both.text
    info = httpx.get(f"{server.url}/tokenizer_info", headers=AUTH).json()
    assert info["eos_token"] == "</s>" and info["chat_template"] == tok.chat_template
    assert info["model_max_length"] == 256
    models = httpx.get(f"{server.url}/v1/models", headers=AUTH).json()
    assert models["data"][0]["max_model_len"] == 256
    # lm-evaluation-harness finds the server's tokenizer by these routes
    utils = pytest.importorskip("lm_eval.utils")
    assert utils.check_remote_tokenizer_support(f"{server.url}/v1/completions", auth_token=KEY)
    remote = utils.RemoteTokenizer(f"{server.url}/v1/completions", auth_token=KEY)
    assert remote.encode("a b") == tok.encode("a b", False) and remote.eos_token_id == 2


def test_api_key_401s_are_openai_errors_and_counted(server):
    before = server.metric("trt_spec:request_rejected_total", reason="unauthorized")
    body = {"model": "tiny", "prompt": "a", "max_tokens": 1}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        r = post(server, "/v1/completions", body, headers)
        assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
        err = r.json()["error"]
        assert err["code"] == "invalid_api_key" and err["type"] == "invalid_request_error"
        assert KEY not in r.text
    for path in ("/v1/models", "/tokenizer_info"):
        assert httpx.get(f"{server.url}{path}").status_code == 401
    assert post(server, "/tokenize", {"prompt": "a"}, {}).status_code == 401
    assert httpx.get(f"{server.url}/health").status_code == 200  # open: liveness probes
    assert httpx.get(f"{server.url}/").status_code == 200  # open: the page asks for the key
    assert httpx.get(f"{server.url}/metrics").status_code == 200  # open: no --protect-metrics
    assert server.metric("trt_spec:request_rejected_total", reason="unauthorized") == before + 6
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{server.url}/v1", api_key="nope", max_retries=0
                      ).completions.create(model="tiny", prompt="a", max_tokens=1)


def test_cors_preflight_and_headers(server):
    pre = httpx.options(f"{server.url}/v1/chat/completions", headers={
        "Origin": ORIGIN, "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type"})
    assert pre.status_code == 200  # no key needed for a preflight
    assert pre.headers["access-control-allow-origin"] == ORIGIN
    assert "POST" in pre.headers["access-control-allow-methods"]
    assert "authorization" in pre.headers["access-control-allow-headers"].lower()
    other = httpx.options(f"{server.url}/v1/completions", headers={
        "Origin": "http://evil.example", "Access-Control-Request-Method": "POST"})
    assert other.status_code == 400 and "access-control-allow-origin" not in other.headers
    ok = post(server, "/v1/completions", {"model": "tiny", "prompt": "a", "max_tokens": 1},
              {**AUTH, "Origin": ORIGIN})
    assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == ORIGIN
    # a 401 carries the CORS headers: the browser client can read why
    denied = post(server, "/v1/models", {}, {"Origin": ORIGIN})
    assert denied.status_code == 401 and denied.headers["access-control-allow-origin"] == ORIGIN


def test_key_from_the_environment_and_protected_metrics(tiny_spec_engine):
    import os

    s = start_server(tiny_spec_engine, "--protect-metrics",
                     env={**os.environ, "TRT_SPEC_API_KEY": KEY})
    try:
        assert httpx.get(f"{s.url}/metrics").status_code == 401
        assert httpx.get(f"{s.url}/metrics", headers=AUTH).status_code == 200
        assert httpx.get(f"{s.url}/health").status_code == 200
        assert httpx.get(f"{s.url}/v1/models", headers=AUTH).status_code == 200
        assert httpx.get(f"{s.url}/v1/models").status_code == 401
    finally:
        assert s.stop() == 0


@pytest.mark.parametrize("args, message", [
    (["--protect-metrics"], "--protect-metrics needs an API key"),
    (["--api-key", "a b"], "the API key must be a non-empty string"),
    (["--api-key", "k", "--allowed-origins", "good.example"],
     "allowed origin 'good.example': expected scheme://host[:port]"),
])
def test_bad_access_options_fail_before_listening(tiny_spec_engine, args, message):
    from click.testing import CliRunner

    from trt_spec.cli import main

    r = CliRunner().invoke(main, ["serve", "--engine", str(tiny_spec_engine), *args])
    assert r.exit_code == 1 and message in r.output, r.output
