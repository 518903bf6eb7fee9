"""`trt-spec serve` with n > 1 and the sampling controls: n choices by index, streamed
interleaved with each chunk's index, seeded alike every time; logit_bias and the penalties
reach the engine as in the Python API; a 400 names the field."""

import httpx
import openai
import pytest

from tests.server_util import start_server
from trt_spec import LLM, SamplingParams
from trt_spec.runtime.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def server(tiny_spec_engine):
    s = start_server(tiny_spec_engine, "--max-num-seqs", "4", "--method", "vanilla")
    yield s
    assert s.stop() == 0


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


SAMPLED = dict(model="tiny", max_tokens=10, temperature=1.0, seed=11,
               extra_body={"ignore_eos": True})


def test_completions_n_choices_streamed_equal_whole(client):
    full = client.completions.create(prompt="a b c", n=3, **SAMPLED)
    assert [c.index for c in full.choices] == [0, 1, 2]
    texts = [c.text for c in full.choices]
    assert len(set(texts)) > 1  # three draws, not one
    assert full.usage.completion_tokens == 30 and full.usage.prompt_tokens == 3
    assert [c.text for c in client.completions.create(prompt="a b c", n=3, **SAMPLED)
            .choices] == texts  # a seed gives the same n answers every time
    one = client.completions.create(prompt="a b c", **{**SAMPLED, "seed": 12})
    assert one.choices[0].text == texts[1]  # choice i draws with seed + i
    chunks = list(client.completions.create(prompt="a b c", n=3, stream=True, **SAMPLED,
                                            stream_options={"include_usage": True}))
    streamed = ["", "", ""]
    for c in chunks[:-1]:
        (choice,) = c.choices
        streamed[choice.index] += choice.text
    assert streamed == texts
    finals = [c.choices[0] for c in chunks[:-1] if c.choices[0].finish_reason]
    assert sorted(f.index for f in finals) == [0, 1, 2]
    assert chunks[-1].usage.completion_tokens == 30
    indices = [c.choices[0].index for c in chunks[:-1]]
    assert indices != sorted(indices)  # interleaved as they come


def test_chat_n_choices(client):
    kw = dict(messages=[{"role": "user", "content": "h i"}], n=2, **SAMPLED)
    full = client.chat.completions.create(**kw)
    assert [c.index for c in full.choices] == [0, 1]
    chunks = list(client.chat.completions.create(**kw, stream=True))
    assert [c.choices[0].delta.role for c in chunks[:2]] == ["assistant"] * 2
    assert [c.choices[0].index for c in chunks[:2]] == [0, 1]
    streamed = ["", ""]
    for c in chunks:
        streamed[c.choices[0].index] += c.choices[0].delta.content or ""
    assert streamed == [c.message.content for c in full.choices]


def test_controls_reach_the_engine(client, tiny_spec_engine):
    """Greedy under the penalties and a bias: the Python API's answer; a bias of 100 makes a
    token certain, sampled or not."""
    controls = dict(presence_penalty=0.8, frequency_penalty=0.6)
    extra = {"ignore_eos": True, "repetition_penalty": 1.3, "min_p": 0.1}
    got = client.completions.create(model="tiny", prompt="d e f", max_tokens=12, temperature=0,
                                    logit_bias={"9": 1.5}, **controls, extra_body=extra)
    want = LLM(tiny_spec_engine).generate("d e f", SamplingParams(
        max_tokens=12, logit_bias={9: 1.5}, repetition_penalty=1.3, min_p=0.1, **controls,
        ignore_eos=True), chat=False)[0]
    assert got.choices[0].text == want.text
    plain = client.completions.create(model="tiny", prompt="d e f", max_tokens=12,
                                      temperature=0, extra_body={"ignore_eos": True})
    assert plain.choices[0].text != want.text
    forced = client.completions.create(prompt="d e f", logit_bias={"7": 100}, **SAMPLED)
    assert forced.choices[0].text == Tokenizer(tiny_spec_engine).decode([7] * 10)


@pytest.mark.parametrize("body, param", [
    ({"n": 9}, "n"), ({"logit_bias": {"128": 1}}, "logit_bias"),
    ({"logit_bias": {"3": -101}}, "logit_bias"), ({"min_p": -0.1}, "min_p"),
    ({"repetition_penalty": -1}, "repetition_penalty"),
])
def test_a_400_names_the_field(server, body, param):
    r = httpx.post(f"{server.url}/v1/completions", json={"model": "tiny", "prompt": "a",
                                                         "max_tokens": 2, **body})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_prompt_list_times_n_is_prompt_major(client):
    """2 prompts x n=2: indices 0..3, prompt i's choice j at i * 2 + j, drawn with seed + j
    (what a request of that prompt alone with n: 1 and that seed gets); streamed alike."""
    prompts = ["a b c", "d e"]
    kw = {**SAMPLED, "max_tokens": 6}
    full = client.completions.create(prompt=prompts, n=2, **kw)
    assert [c.index for c in full.choices] == [0, 1, 2, 3]
    for i, p in enumerate(prompts):
        for j in range(2):
            one = client.completions.create(prompt=p, **{**kw, "seed": kw["seed"] + j})
            assert full.choices[i * 2 + j].text == one.choices[0].text, (i, j)
    assert full.usage.prompt_tokens == 5 and full.usage.completion_tokens == 24
    streamed = [""] * 4
    for c in client.completions.create(prompt=prompts, n=2, stream=True, **kw):
        streamed[c.choices[0].index] += c.choices[0].text
    assert streamed == [c.text for c in full.choices]


def test_forked_choices_keep_the_prompt_logprobs(client):
    """echo with logprobs and n: every choice echoes its prompt with the prompt's logprobs
    (the forked choices copy choice 0's, read once), at max_tokens 0 and past it."""
    for max_tokens in (0, 2):
        r = client.completions.create(model="tiny", prompt=["a b c", "d e"], n=2, echo=True,
                                      logprobs=1, max_tokens=max_tokens, temperature=1.0,
                                      seed=3)
        assert [c.index for c in r.choices] == [0, 1, 2, 3]
        for i, prompt in enumerate(["a b c", "d e"]):
            first, second = r.choices[2 * i], r.choices[2 * i + 1]
            assert first.text.startswith(prompt) and second.text.startswith(prompt)
            n = len(first.logprobs.token_logprobs) - max_tokens
            assert first.logprobs.token_logprobs[0] is None
            assert first.logprobs.token_logprobs[:n] == second.logprobs.token_logprobs[:n]
            assert len(second.logprobs.token_logprobs) == n + max_tokens
