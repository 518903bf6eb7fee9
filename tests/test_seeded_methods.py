"""A seed means the same tokens under every method and k (runtime/race.py, runtime/verify.py):
seeded sampled output equals plain seeded output token for token, on every method of a tiny
engine folder, at k = 1, 2, 4 and auto, alone and in a batch of 4, with the policy's gain
rules on (seeded requests are not exempt from them), after a prefix-cache hit, in chunked
prefill, under a structure and the sampling controls, for each of n = 2 choices, and through
the server (every method and k, and its defaults)."""

import dataclasses
import json

import httpx
import pytest

from tests.server_util import start_server
from trt_spec import LLM
from trt_spec.runtime.generator import Generator
from trt_spec.runtime.sampling import SamplingParams
from trt_spec.runtime.scheduler import generate_ids

# the heads draft over 48 of the folder's 128 ids (tiny_vocab_engine); a bias on three of
# them in p and q alike makes the random heads' drafts hit, and the repeating prompts make
# the lookups find drafts
A, B, C = 16, 28, 40
PROMPTS = [[A, B, C, A, B, C, A, B], [42, 8, 77, 61, 23, 11, 90, 8, 77],
           [5, 17, 99, 3, 17, 99, 3, 17], [A, 9, B, 9, C, 9, A]]
SAMPLED = SamplingParams(max_tokens=16, temperature=1.0, seed=11, ignore_eos=True,
                         logit_bias={A: 4.0, B: 4.0, C: 4.0})
METHODS = ["vanilla", "ngram", "suffix", "mtp", "eagle", "eagle3", "hybrid", "auto"]
KS = [1, 2, 4, "auto"]


@pytest.fixture(scope="module")
def gen(tiny_vocab_engine):
    return Generator(tiny_vocab_engine, max_batch=4, max_len=48)


@pytest.fixture(scope="module")
def always(tiny_vocab_engine):
    """Drafts k every step (the gain rules would stop a random head that does not pay)."""
    return Generator(tiny_vocab_engine, max_batch=4, max_len=48, fallback=False)


def plain(gen: Generator, params: SamplingParams = SAMPLED, prompts=PROMPTS) -> list[list[int]]:
    return [s.output_ids for s in generate_ids(gen, prompts, params, "none")]


@pytest.fixture(scope="module")
def want(gen):
    return plain(gen)


def test_the_folder_has_every_method(gen):
    assert set(METHODS) <= set(gen.methods)


@pytest.mark.parametrize("method", METHODS)
def test_every_k_and_batch_equals_plain(gen, always, want, method):
    """Batch 4 (the prompts together) and batch 1 (each alone), at every k, under the gain
    rules and drafting every step: plain's tokens; and drafts were accepted, so the coupling
    was exercised."""
    accepted = 0
    for g in (gen, always):
        for k in KS:
            together = generate_ids(g, PROMPTS, SAMPLED, method, k)
            assert [s.output_ids for s in together] == want, (method, k)
            for prompt, w in zip(PROMPTS, want):
                alone = generate_ids(g, [prompt], SAMPLED, method, k)[0]
                assert alone.output_ids == w, (method, k, prompt)
            accepted += sum(s.stats.accepted for s in together)
    assert accepted > 0, method


def test_a_prefix_cache_hit_and_chunked_prefill_equal_plain(tiny_vocab_engine, want):
    """The second run of the prompts finds their rows in the prefix cache (and the suffix
    cache holds the first run's answers); prefill read 3 tokens a step."""
    for method in ("auto", "hybrid", "eagle3"):
        g = Generator(tiny_vocab_engine, max_batch=4, max_len=48, max_prefill_tokens=3)
        for _ in range(2):
            assert [s.output_ids for s in generate_ids(g, PROMPTS, SAMPLED, method, 2)] == want
        assert g.prefix_cache.stats.cached_tokens > 0, method


@pytest.mark.parametrize("controls", [
    dict(regex="(a|b|c)+(x|y)(a|b|c)*"),
    dict(top_p=0.9, top_k=20, temperature=0.7),
    dict(presence_penalty=1.2, frequency_penalty=0.8, repetition_penalty=1.3, min_p=0.05),
], ids=["regex", "top-p top-k temperature", "penalties min-p"])
# (a JSON schema: the tiny tokenizer cannot spell JSON; tests/test_seeded_methods_smollm2.py)
def test_a_structure_and_the_sampling_controls_equal_plain(gen, controls):
    params = dataclasses.replace(SAMPLED, **controls)
    w = plain(gen, params)
    for method in ("vanilla", "eagle3", "suffix", "auto"):
        assert [s.output_ids for s in generate_ids(gen, PROMPTS, params, method, 3)] == w, \
            (method, controls)


def test_n_choices_equal_plain_and_the_seed_is_returned(tiny_vocab_engine):
    """n = 2 through LLM: each choice is plain decoding's under every method, choice 1 is
    what seed + 1 gives alone; a request without a seed gets one, returned, which gives the
    same outputs again."""
    text = "a b c a b c a b"
    params = dataclasses.replace(SAMPLED, n=2, logit_bias={})
    want = None
    for method in ("none", "mtp", "suffix", "auto"):
        llm = LLM(tiny_vocab_engine, method=method, max_num_seqs=4, max_model_len=48)
        out = llm.generate([text], params, chat=False)[0]
        assert out.seed == SAMPLED.seed
        got = [c.token_ids for c in out.outputs]
        want = want or got
        assert got == want, method
        one = llm.generate([text], dataclasses.replace(params, n=1, seed=SAMPLED.seed + 1),
                           chat=False)[0]
        assert one.token_ids == got[1], method
        free = SamplingParams(max_tokens=8, temperature=1.0)
        unseeded = llm.generate([text], free, chat=False)[0]
        assert unseeded.seed is not None
        again = llm.generate([text], dataclasses.replace(free, seed=unseeded.seed),
                             chat=False)[0]
        assert again.token_ids == unseeded.token_ids, method
    assert want[0] != want[1]


def test_the_server_gives_plain_text_under_every_method_and_k(tiny_vocab_engine):
    """Through `trt-spec serve`, each method at each k, n = 2: plain's two answers."""
    server = start_server(tiny_vocab_engine, "--max-num-seqs", "4")
    try:
        def ask(speculative):
            body = {"model": "tiny", "messages": [{"role": "user", "content": "a b c a b c"}],
                    "max_tokens": 12, "temperature": 0.9, "ignore_eos": True, "seed": 3,
                    "n": 2, "speculative": speculative}
            r = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60)
            assert r.status_code == 200, r.text
            return [c["message"]["content"] for c in r.json()["choices"]]

        plain = ask({"method": "none"})
        for method in METHODS:
            for k in KS:
                assert ask({"method": method, "num_draft_tokens": k}) == plain, (method, k)
    finally:
        assert server.stop() == 0


def test_the_server_answers_a_seeded_request_alike_every_time(tiny_vocab_engine):
    """The server's defaults (method auto, the gain rules on, the suffix cache): the same
    seeded chat request, n = 1 and n = 2, streamed or not, gives the same answer again, and
    after other traffic has filled the suffix cache with its own answer; a request without a
    seed is answered with the seed drawn for it, which gives the same answer again."""
    server = start_server(tiny_vocab_engine, "--max-num-seqs", "4")
    try:
        def ask(**body):
            body = {"model": "tiny", "messages": [{"role": "user", "content": "a b c a b c"}],
                    "max_tokens": 24, "temperature": 0.9, "ignore_eos": True, **body}
            r = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60)
            assert r.status_code == 200, r.text
            return r.json()

        def texts(answer):
            return [c["message"]["content"] for c in answer["choices"]]

        first = {n: ask(seed=5, n=n) for n in (1, 2)}
        assert first[1]["seed"] == 5 and first[1]["metrics"]["method"] == "auto"
        assert texts(first[2])[0] == texts(first[1])[0]
        for n in (1, 2):
            assert texts(ask(seed=5, n=n)) == texts(first[n]), n
        for seed in range(6):  # other traffic, the same prompt among it: the suffix cache
            ask(seed=seed, n=2)  # holds answers that continue it
        for n in (1, 2):
            assert texts(ask(seed=5, n=n)) == texts(first[n]), n
        streamed = httpx.post(f"{server.url}/v1/chat/completions", timeout=60, json={
            "model": "tiny", "messages": [{"role": "user", "content": "a b c a b c"}],
            "max_tokens": 24, "temperature": 0.9, "ignore_eos": True, "seed": 5,
            "stream": True}).text
        chunks = [json.loads(line[6:]) for line in streamed.splitlines()
                  if line.startswith("data: {")]
        assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks
                       if c["choices"]) == texts(first[1])[0]
        assert [c["seed"] for c in chunks if "seed" in c] == [5]
        free = ask()
        assert texts(ask(seed=free["seed"])) == texts(free)
    finally:
        assert server.stop() == 0
