"""`trt-spec serve` as a real process on 127.0.0.1, driven by the official openai client and
raw HTTP: completions and chat, streamed and not, 8 concurrent streams, per-request methods,
metrics, and every kind of bad input (4xx, then the server still serves)."""

import asyncio
import json
import re

import httpx
import openai
import pytest

from tests.server_util import start_server
from trt_spec import LLM, SamplingParams
from trt_spec.runtime.prefix_cache import MIN_TOKENS

EXTRA = {"ignore_eos": True}  # greedy outputs of a fixed length


@pytest.fixture(scope="module")
def server(tiny_spec_engine):
    s = start_server(tiny_spec_engine, "--max-num-seqs", "4", "--max-waiting", "64")
    yield s
    assert s.stop() == 0


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def test_health_and_models(server, client):
    assert httpx.get(f"{server.url}/health").json() == {"status": "ok"}
    models = client.models.list().data
    assert [m.id for m in models] == ["tiny"]
    assert models[0].model_extra["methods"] == ["none", "vanilla", "ngram", "suffix", "hybrid",
                                                "auto"]
    assert models[0].model_extra["max_model_len"] == 256


def test_chat_streamed_equals_non_streamed(client):
    kw = dict(model="tiny", messages=[{"role": "user", "content": "a b c"}], max_tokens=20,
              temperature=0, extra_body=EXTRA)
    full = client.chat.completions.create(**kw)
    assert full.object == "chat.completion" and full.choices[0].finish_reason == "length"
    assert full.usage.completion_tokens == 20
    chunks = list(client.chat.completions.create(**kw, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert streamed == full.choices[0].message.content != ""
    assert len(chunks) > 3  # it did come in pieces
    assert [c.choices[0].finish_reason for c in chunks[:-1]] == [None] * (len(chunks) - 1)
    assert chunks[-1].choices[0].finish_reason == "length"
    assert all(c.usage is None for c in chunks)  # usage only when asked, as OpenAI
    # stream_options.include_usage: one more chunk, with empty choices, carrying usage
    asked = list(client.chat.completions.create(**kw, stream=True,
                                                stream_options={"include_usage": True}))
    counts = ("prompt_tokens", "completion_tokens", "total_tokens")
    assert asked[-1].choices == [] and all(getattr(asked[-1].usage, n) == getattr(full.usage, n)
                                           for n in counts)
    # the same prompt again: its KV comes from the prefix cache, all but its last token,
    # when that is enough to count (this prompt is short)
    shared = full.usage.prompt_tokens - 1
    cached = asked[-1].usage.prompt_tokens_details.cached_tokens
    assert cached == (shared if shared >= MIN_TOKENS else 0)
    assert all(c.usage is None for c in asked[:-1])
    assert "".join(c.choices[0].delta.content or "" for c in asked[:-1]) == streamed


def test_text_streamed_equals_non_streamed(client):
    kw = dict(model="tiny", prompt="d e f g", max_tokens=12, temperature=0, extra_body=EXTRA)
    full = client.completions.create(**kw)
    assert full.object == "text_completion" and full.usage.prompt_tokens == 4
    chunks = list(client.completions.create(**kw, stream=True,
                                            stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks[:-1]) == full.choices[0].text != ""
    assert chunks[-2].choices[0].finish_reason == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    # token ids as the prompt
    ids = client.completions.create(**{**kw, "prompt": [5, 6, 7, 8]})
    assert ids.usage.prompt_tokens == 4


def test_stop_string_streamed_equals_non_streamed(client):
    kw = dict(model="tiny", prompt="d e f g", max_tokens=12, temperature=0, extra_body=EXTRA)
    word = client.completions.create(**kw).choices[0].text.split()[5]
    full = client.completions.create(**kw, stop=[word, "zzz"])
    assert full.choices[0].finish_reason == "stop" and word not in full.choices[0].text
    chunks = list(client.completions.create(**kw, stop=[word, "zzz"], stream=True))
    assert "".join(c.choices[0].text for c in chunks) == full.choices[0].text
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_server_matches_the_python_api(client, tiny_spec_engine):
    llm = LLM(tiny_spec_engine)
    want = llm.generate([[{"role": "user", "content": "h i"}]],
                        SamplingParams(max_tokens=15, ignore_eos=True))[0].text
    got = client.chat.completions.create(model="tiny", messages=[{"role": "user",
                                                                  "content": "h i"}],
                                         max_tokens=15, temperature=0, extra_body=EXTRA)
    assert got.choices[0].message.content == want


PROMPTS = ["a b c", "d e", "f g h i j", "k", "l m n o", "p q r", "s t u v w x", "y z"]
METHODS = [None, {"method": "ngram", "num_draft_tokens": 2}, {"method": "vanilla"},
           {"method": "none"}, {"method": "vanilla", "num_draft_tokens": 3},
           {"method": "ngram"}, None, {"method": "vanilla", "num_draft_tokens": 1}]


def test_8_concurrent_streams_equal_their_sequential_outputs(server, client):
    """8 streaming clients on 4 slots with mixed methods and lengths: all finish, each with
    the output it has when it runs alone (greedy; speculation is lossless)."""
    lengths = [10 + 3 * i for i in range(8)]
    sequential = [client.completions.create(model="tiny", prompt=p, max_tokens=n, temperature=0,
                                            extra_body=EXTRA).choices[0].text
                  for p, n in zip(PROMPTS, lengths)]
    drafts_before = server.metric("trt_spec:spec_decode_num_draft_tokens_total")

    async def one(aclient, p, n, spec):
        extra = {**EXTRA, **({"speculative": spec} if spec else {})}
        stream = await aclient.completions.create(model="tiny", prompt=p, max_tokens=n,
                                                  temperature=0, stream=True, extra_body=extra,
                                                  stream_options={"include_usage": True})
        text, last, usage = "", None, None
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].text
                last = chunk
            usage = chunk.usage
        return text, (last, usage)

    async def main():
        aclient = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused",
                                     max_retries=0)
        return await asyncio.gather(*(one(aclient, p, n, spec)
                                      for p, n, spec in zip(PROMPTS, lengths, METHODS)))

    results = asyncio.run(main())
    assert [text for text, _ in results] == sequential
    for (_, (last, usage)), n, spec in zip(results, lengths, METHODS):
        assert last.choices[0].finish_reason == "length"
        assert usage.completion_tokens == n
        # no method named: the server's default, auto where the folder has a drafter
        assert last.model_extra["metrics"]["method"] == (spec or {}).get("method", "auto")
    assert server.metric("trt_spec:spec_decode_num_draft_tokens_total") > drafts_before
    assert server.metric("trt_spec:kv_cache_slots_used") == 0


@pytest.fixture(scope="module")
def every_step_server(tiny_spec_engine):
    """A server whose drafters draft their k every step (the gain rules off): the tiny random
    drafter never pays, so with the rules on a vanilla request may draft nothing at all."""
    s = start_server(tiny_spec_engine, "--max-num-seqs", "2", "--no-spec-fallback")
    yield s
    assert s.stop() == 0


def test_per_request_speculation_and_its_metrics(every_step_server):
    server = every_step_server
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    names = ["spec_decode_num_drafts_total", "spec_decode_num_draft_tokens_total",
             "spec_decode_num_accepted_tokens_total", "generation_tokens_total"]
    before = {n: server.metric(f"trt_spec:{n}") for n in names}
    pos_before = [server.metric("trt_spec:spec_decode_num_accepted_tokens_per_pos_total",
                                position=str(i)) for i in range(4)]
    kw = dict(model="tiny", messages=[{"role": "user", "content": "a b a b a b"}],
              max_tokens=30, temperature=0, extra_body=EXTRA)
    plain = client.chat.completions.create(
        **{**kw, "extra_body": {**EXTRA, "speculative": {"method": "none"}}})
    spec = client.chat.completions.create(
        **{**kw, "extra_body": {**EXTRA, "speculative": {"method": "vanilla",
                                                         "num_draft_tokens": 4}}})
    assert spec.choices[0].message.content == plain.choices[0].message.content
    m = spec.model_extra["metrics"]
    assert m["method"] == "vanilla" and m["num_draft_tokens"] == 4
    assert m["proposed_tokens"] > 0 and plain.model_extra["metrics"]["proposed_tokens"] == 0
    after = {n: server.metric(f"trt_spec:{n}") for n in names}
    assert after["spec_decode_num_draft_tokens_total"] - \
        before["spec_decode_num_draft_tokens_total"] == m["proposed_tokens"]
    accepted = after["spec_decode_num_accepted_tokens_total"] - \
        before["spec_decode_num_accepted_tokens_total"]
    assert accepted == m["accepted_tokens"]
    pos_after = [server.metric("trt_spec:spec_decode_num_accepted_tokens_per_pos_total",
                               position=str(i)) for i in range(4)]
    assert sum(pos_after) - sum(pos_before) == accepted
    assert after["spec_decode_num_drafts_total"] > before["spec_decode_num_drafts_total"]
    assert after["generation_tokens_total"] - before["generation_tokens_total"] == 60


GOOD = {"model": "tiny", "prompt": "a b", "max_tokens": 3}
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "a b"}], "max_tokens": 3}
LONG = " ".join(["a"] * 300)

BAD = [  # (path, body, status, message)
    ("completions", b'{"model": "tiny", "prompt": ', 400, "the request body is not valid JSON"),
    ("completions", b"[1, 2]", 400, "the request body must be a JSON object, got list"),
    ("completions", b'{"model": "tiny", "prompt": "a \xff b"}', 400,
     "the request body is not valid UTF-8: byte 0xff"),
    ("completions", b'{"model": "tiny", "prompt": "a \\ud800 b"}', 400,
     "prompt holds '\\ud800' (a lone surrogate), which is not valid UTF-8"),
    ("completions", {"model": "tiny"}, 400, "missing required field 'prompt'"),
    ("chat/completions", {"model": "tiny"}, 400, "missing required field 'messages'"),
    ("completions", {"prompt": "a"}, 400, "missing required field 'model'"),
    ("completions", {**GOOD, "model": "gpt-4"}, 404,
     "model 'gpt-4' does not exist; this server serves 'tiny'"),
    ("completions", {**GOOD, "max_tokens": -1}, 400, "max_tokens=-1: must be an integer >= 0"),
    ("chat/completions", {**CHAT, "max_tokens": -5}, 400, "max_tokens=-5: must be an integer >= 0"),
    ("completions", {**GOOD, "max_tokens": 1000}, 400,
     "max_tokens=1000: the prompt has 2 tokens and the context holds 256, so at most 254"),
    ("completions", {**GOOD, "temperature": -0.5}, 400, "temperature=-0.5: must be a finite number in 0..1e20"),
    ("completions", {**GOOD, "temperature": "hot"}, 400,
     "temperature: Input should be a valid number"),
    ("completions", {**GOOD, "top_p": 0}, 400, "top_p=0.0: must be a finite number in 1e-20..1"),
    ("chat/completions", {**CHAT, "top_p": 1.5}, 400, "top_p=1.5: must be a finite number in 1e-20..1"),
    ("completions", {**GOOD, "n": 5}, 400,
     "n=5: at most 4 choices per request (--max-num-seqs 4; each choice decodes"),
    ("chat/completions", {**CHAT, "n": 0}, 400, "n=0: must be an integer >= 1"),
    ("completions", {**GOOD, "prompt": LONG}, 400,
     "the prompt has 300 tokens; the context holds 256"),
    ("chat/completions", {**CHAT, "messages": [{"role": "user", "content": LONG}]}, 400,
     "tokens; the context holds 256"),
    ("completions", {**GOOD, "stop": ["a", "b", "c", "d", "e"]}, 400,
     "stop has 5 strings; at most 4 are allowed"),
    ("completions", {**GOOD, "stop": [""]}, 400, "each must have 1..256"),
    ("completions", {**GOOD, "prompt": [5, 999]}, 400, "prompt token ids [999] are outside 0..127"),
    ("completions", {**GOOD, "prompt": ""}, 400, "prompt is empty"),
    ("chat/completions", {**CHAT, "messages": []}, 400,
     "messages=[]: expected a non-empty list of {'role', 'content'} messages"),
    ("chat/completions", {**CHAT, "messages": [{"role": "robot", "content": "x"}]}, 400,
     "messages[0].role='robot': must be one of system, developer, user, assistant"),
    ("completions", {**GOOD, "best_of": 2}, 400, "unknown field 'best_of'; accepted fields: model"),
    ("completions", {**GOOD, "frequency_penalty": 2.5}, 400,
     "frequency_penalty=2.5: must be a finite number in -2..2"),
    ("chat/completions", {**CHAT, "presence_penalty": -3}, 400,
     "presence_penalty=-3.0: must be a finite number in -2..2"),
    ("completions", {**GOOD, "repetition_penalty": 0}, 400,
     "repetition_penalty=0.0: must be a finite number in 1e-20..1e20"),
    ("completions", {**GOOD, "repetition_penalty": 1e-310}, 400,  # its logits would overflow
     "repetition_penalty=1e-310: must be a finite number in 1e-20..1e20"),
    ("completions", {**GOOD, "min_p": 1.5}, 400, "min_p=1.5: must be a finite number in 0..1"),
    ("completions", {**GOOD, "logit_bias": {"500": 1}}, 400,
     "logit_bias has token ids [500] outside the vocabulary 0..127"),
    ("chat/completions", {**CHAT, "logit_bias": {"5": 150}}, 400,
     "logit_bias[5]=150: must be a finite number in -100..100"),
    ("completions", {**GOOD, "logit_bias": {"five": 1}}, 400,
     "logit_bias key 'five': expected a token id"),
    ("completions", {**GOOD, "logit_bias": [5, 1]}, 400,
     "expected an object of token id -> bias"),
    ("completions", {**GOOD, "speculative": {"method": "eagle3"}}, 400,
     "has no eagle3 drafter (export it with --eagle3 CHECKPOINT); methods here: none, "
     "vanilla, ngram, suffix, hybrid"),
    ("chat/completions", {**CHAT, "speculative": {"method": "ngram", "num_draft_tokens": 0}},
     400, "num_draft_tokens=0: must be an integer in 1..64"),
    ("completions", {**GOOD, "speculative": {"method": "none", "num_draft_tokens": 2}}, 400,
     "method 'none' drafts nothing"),
    ("completions", {**GOOD, "speculative": {"k": 2}}, 400, "unknown field 'speculative.k'"),
]


@pytest.mark.parametrize("path, body, status, message", BAD,
                         ids=[f"{i}-{b[3][:30]}" for i, b in enumerate(BAD)])
def test_bad_input_gets_4xx_and_the_server_keeps_serving(server, path, body, status, message):
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = httpx.post(f"{server.url}/v1/{path}", content=content,
                   headers={"Content-Type": "application/json"})
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert message in error["message"], error["message"]
    assert error["type"] == "invalid_request_error"
    ok = httpx.post(f"{server.url}/v1/completions", json=GOOD)
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] >= 1


def test_a_temperature_below_the_epsilon_is_greedy(server):
    """1e-310 made the target's distribution NaN; below 1e-5 a request is greedy."""
    body = {**GOOD, "max_tokens": 8, "ignore_eos": True}
    answers = [httpx.post(f"{server.url}/v1/completions", json={**body, "temperature": t})
               for t in (0, 1e-310)]
    assert [r.status_code for r in answers] == [200, 200]
    assert answers[0].json()["choices"][0]["text"] == answers[1].json()["choices"][0]["text"]


def test_null_means_the_default(server):
    body = {**GOOD, "max_tokens": None, "temperature": None, "top_p": None, "n": None,
            "stop": None, "seed": None, "stream": None, "ignore_eos": True}
    r = httpx.post(f"{server.url}/v1/completions", json=body)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 16  # OpenAI's default for completions


def test_bad_routes(server):
    r = httpx.get(f"{server.url}/v1/nothing")
    assert r.status_code == 404 and "POST /v1/chat/completions" in r.json()["error"]["message"]
    r = httpx.get(f"{server.url}/v1/completions")
    assert r.status_code == 405 and "Method Not Allowed" in r.json()["error"]["message"]


def test_the_page_is_served_with_its_script_pinned(server):
    """GET / is the browser page (serve/page.py): UTF-8 HTML whose Content-Security-Policy
    allows its own inline script (by hash) and connections to this server only."""
    import base64
    import hashlib

    r = httpx.get(f"{server.url}/")
    assert r.status_code == 200 and r.headers["content-type"] == "text/html; charset=utf-8"
    script = re.search(r"<script>(.*?)</script>", r.text, re.S).group(1)
    digest = base64.b64encode(hashlib.sha256(script.encode()).digest()).decode()
    policy = r.headers["content-security-policy"]
    assert f"script-src 'sha256-{digest}'" in policy and "connect-src 'self'" in policy
    assert not re.search(r"""(src|href)=["']?(https?:)?//""", r.text)  # nothing from elsewhere
    assert "GET /" in httpx.get(f"{server.url}/nothing").json()["error"]["message"]


def test_openai_client_sees_the_error(server, client):
    with pytest.raises(openai.BadRequestError, match="temperature=-1.0: must be a finite number in 0..1e20"):
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "a"}],
                                       temperature=-1)
    with pytest.raises(openai.NotFoundError, match="model 'nope' does not exist"):
        client.completions.create(model="nope", prompt="a")
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny", prompt="a", max_tokens=300)
    assert e.value.body["param"] == "max_tokens" and "at most 255 new tokens" in e.value.message
    assert server.metric("trt_spec:request_rejected_total", reason="invalid") >= 2


def test_a_chats_next_turn_reads_only_its_new_tokens(server, client, tiny_spec_engine):
    def conversation(c):
        messages = [{"role": "user", "content": "w x y z " * 6}]
        usages, answers = [], []
        for turn in ("a b", "c d e"):
            r = c.chat.completions.create(model="tiny", messages=messages, max_tokens=12,
                                          temperature=0, extra_body=EXTRA)
            answers.append(r.choices[0].message.content)
            usages.append(r.usage)
            messages += [{"role": "assistant", "content": answers[-1]},
                         {"role": "user", "content": turn}]
        return answers, usages

    hits, queries = (server.metric(f"trt_spec:prefix_cache_{n}_total") for n in ("hits",
                                                                                "queries"))
    answers, usages = conversation(client)
    second = usages[1].prompt_tokens_details.cached_tokens
    assert second > usages[0].prompt_tokens  # the whole first turn, answer included
    assert server.metric("trt_spec:prefix_cache_hits_total") - hits >= second
    assert server.metric("trt_spec:prefix_cache_queries_total") - queries == sum(
        u.prompt_tokens for u in usages)
    assert server.metric("trt_spec:prefix_cache_kept_slots") >= 1
    off = start_server(tiny_spec_engine, "--max-num-seqs", "2", "--no-prefix-cache")
    try:
        plain = openai.OpenAI(base_url=f"{off.url}/v1", api_key="unused", max_retries=0)
        plain_answers, plain_usages = conversation(plain)
        assert plain_answers == answers
        assert [u.prompt_tokens_details.cached_tokens for u in plain_usages] == [0, 0]
        assert off.metric("trt_spec:prefix_cache_queries_total") == 0
    finally:
        assert off.stop() == 0


def test_vllm_guided_fields_hold_the_output(server, client):
    """regex, choice and grammar over HTTP (vLLM's guided_* names; response_format carries JSON
    schemas): the tiny model's words concatenated are in the language; a bad one, or two at
    once, is a 400 naming the field."""
    for extra, language in [({"guided_regex": "(ab|xy)c(d|fg)+e"}, "(ab|xy)c(d|fg)+e"),
                            ({"guided_choice": ["rst", "uv"]}, "rst|uv"),
                            ({"guided_grammar": 'start: "p" ("a" | "b" "q")'}, "p(a|bq)")]:
        out = client.completions.create(model="tiny", prompt="a b c", max_tokens=24,
                                        temperature=0, extra_body=extra)
        choice = out.choices[0]
        assert choice.finish_reason == "stop", extra
        assert re.fullmatch(language, choice.text.replace(" ", "")), (extra, choice.text)
    for extra, param in [({"guided_regex": "("}, "guided_regex"),
                         ({"guided_choice": [1, 2]}, "guided_choice"),
                         ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice")]:
        r = httpx.post(f"{server.url}/v1/completions", timeout=30,
                       json={"model": "tiny", "prompt": "a", "max_tokens": 4, **extra})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (extra, r.text)


def test_the_suffix_cache_fill_is_on_metrics(every_step_server):
    """What `make load` warms up until: the suffix lookups' cache holds each ended request's
    prompt and output, up to its bound."""
    s = every_step_server
    before = s.metric("trt_spec:suffix_cache_tokens")
    r = httpx.post(f"{s.url}/v1/completions", timeout=60, json={
        "model": "tiny", "prompt": [5, 6, 7, 8, 9], "max_tokens": 6, "temperature": 0,
        "ignore_eos": True, "speculative": {"method": "suffix"}})
    assert r.status_code == 200, r.text
    assert s.metric("trt_spec:suffix_cache_tokens") == before + 5 + 6
    assert s.metric("trt_spec:suffix_cache_max_tokens") == 65536
