"""A seed means the same text under every method and k, on SmolLM2 int4 with its shipped
drafters (runtime/race.py, runtime/verify.py): seeded sampled output equals plain (method
none) seeded output token for token, through `LLM` (every method at k = 1, 2, 4 and auto,
batch 4 and batch 1, a prefix-cache hit, chunked prefill, a JSON schema, the sampling
controls, n = 2) and through `trt-spec serve` (every method with n = 2; the server's defaults
asked twice and after other traffic has filled the suffix cache). The tiny models' version,
every case at more k and batch shapes: tests/test_seeded_methods.py.

Compact, for a loaded CPU: one LLM and one server for the module, 8 to 12 new tokens a case,
drafting every step in `LLM` (the gain rules would skip some drafts on a CPU, and a draft not
made is not verified)."""

import dataclasses
from pathlib import Path

import httpx
import pytest

from tests.server_util import start_server
from trt_spec import LLM
from trt_spec.runtime.sampling import SamplingParams

pytestmark = pytest.mark.slow

SHIPPED = Path(__file__).resolve().parents[1] / "engines" / "smollm2-135m"
METHODS = ["vanilla", "ngram", "suffix", "mtp", "eagle", "eagle3", "hybrid", "auto"]
KS = [1, 2, 4, "auto"]
# raw text (no chat template: short prompts); the first repeats itself, so lookups draft
PROMPTS = ["red green blue, red green blue, red green blue, red green blue, red",
           "The capital of France is",
           "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
           "Once upon a time, in a small village by the sea,"]
SAMPLED = SamplingParams(max_tokens=8, temperature=0.8, top_p=0.95, seed=7, ignore_eos=True)


@pytest.fixture(scope="module")
def engine(request):
    """The folder `trt-spec export` writes by default (engines/smollm2-135m: int4 and the
    shipped drafters) where this checkout has one, else the same exported here."""
    if (SHIPPED / "manifest.json").exists():
        return SHIPPED
    return request.getfixturevalue("smollm2_int4_spec_engine")


@pytest.fixture(scope="module")
def llm(engine):
    """Drafts k on every step; prefill reads 8 tokens a step (every prompt but the
    shortest is chunked)."""
    return LLM(engine, max_num_seqs=4, max_model_len=256, spec_fallback=False, threads=2,
               max_prefill_tokens=8)


def ids(outputs) -> list[list[int]]:
    return [o.token_ids for o in outputs]


def run(llm, method, k=None, params=SAMPLED, prompts=PROMPTS):
    return llm.generate(prompts, params, method=method, num_draft_tokens=k, chat=False)


@pytest.fixture(scope="module")
def want(llm):
    return ids(run(llm, "none"))


def test_the_folder_has_every_method(llm):
    assert set(METHODS) <= set(llm.methods)


@pytest.mark.parametrize("method", METHODS)
def test_every_k_batch_4_and_1_equals_plain(llm, want, method):
    """The four prompts together at every k, and one of them alone at every other k (each k
    alone under half the methods; a different prompt per k): plain's tokens; and drafts were
    accepted, so verification had drafts to keep."""
    accepted = 0
    for i, k in enumerate(KS):
        together = run(llm, method, k)
        assert ids(together) == want, (method, k)
        accepted += sum(o.metrics.accepted_tokens for o in together)
        if (i + METHODS.index(method)) % 2 == 0:
            alone = run(llm, method, k, prompts=[PROMPTS[i]])
            assert ids(alone) == [want[i]], (method, k, i)
    assert accepted > 0, method


def test_a_prefix_cache_hit_equals_plain(llm, want):
    """The prompts asked again find their rows in the prefix cache (read in chunks of 8 the
    first time; the longer ones share more than its 8-token minimum)."""
    for method in ("eagle3", "auto"):
        again = run(llm, method, 2)
        assert ids(again) == want, method
        assert [o.metrics.cached_tokens > 0 for o in again] == [True, False, True, True], \
            method


@pytest.mark.parametrize("controls", [
    dict(json_schema='{"type": "object", "properties": {"name": {"type": "string"}, '
                     '"age": {"type": "integer"}}, "required": ["name", "age"]}',
         max_tokens=12),
    dict(top_k=30, min_p=0.02, temperature=1.0, top_p=0.9, presence_penalty=0.6,
         frequency_penalty=0.4, repetition_penalty=1.2, logit_bias={11: -5.0}),
], ids=["json schema", "sampling controls"])
def test_a_json_schema_and_the_sampling_controls_equal_plain(llm, controls):
    params = dataclasses.replace(SAMPLED, **controls)
    plain = ids(run(llm, "none", params=params))
    for method, k in (("vanilla", 2), ("suffix", 4), ("eagle3", "auto"), ("auto", "auto")):
        assert ids(run(llm, method, k, params)) == plain, (method, k, controls)


def test_n_2_equals_plain_choice_by_choice(llm):
    """Choice c is plain's with seed + c; each method gives both, and the seed back."""
    params = dataclasses.replace(SAMPLED, n=2)
    prompt = [PROMPTS[0]]
    plain = run(llm, "none", params=params, prompts=prompt)[0]
    want = [c.token_ids for c in plain.outputs]
    assert want[0] != want[1]
    second = run(llm, "none", params=dataclasses.replace(SAMPLED, seed=SAMPLED.seed + 1),
                 prompts=prompt)[0]
    assert second.token_ids == want[1]
    for method, k in (("mtp", 4), ("eagle3", 2), ("hybrid", "auto"), ("auto", "auto")):
        out = run(llm, method, k, params, prompt)[0]
        assert out.seed == SAMPLED.seed
        assert [c.token_ids for c in out.outputs] == want, (method, k)


CHAT = [{"role": "user", "content": "Name three colours, then repeat them."}]


@pytest.fixture(scope="module")
def server(engine):
    """`trt-spec serve` as a user starts it: its defaults (method auto, the gain rules, the
    suffix cache)."""
    s = start_server(engine, "--max-num-seqs", "4", model="smollm2", timeout=300)
    yield s
    assert s.stop() == 0


def ask(server, **body) -> dict:
    body = {"model": "smollm2", "messages": CHAT, "max_tokens": 12, "temperature": 0.9,
            "top_p": 0.95, "ignore_eos": True, **body}
    r = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()


def texts(answer: dict) -> list[str]:
    return [c["message"]["content"] for c in answer["choices"]]


def test_the_server_gives_plain_text_under_every_method(server):
    """n = 2 under each method, each at one k (every k among them): plain's two answers."""
    plain = ask(server, seed=5, n=2, speculative={"method": "none"})
    assert plain["seed"] == 5 and len(set(texts(plain))) == 2
    for method, k in zip(METHODS, KS + KS):
        got = ask(server, seed=5, n=2, speculative={"method": method, "num_draft_tokens": k})
        assert texts(got) == texts(plain), (method, k)


def test_the_servers_defaults_answer_a_seed_alike_every_time(server):
    """The server's defaults (auto): the same seeded request twice, then again after other
    traffic (the same chat among it) has filled the suffix cache: the same answer, n = 1 and
    n = 2; and plain decoding's."""
    first = {n: ask(server, seed=9, n=n) for n in (1, 2)}
    assert first[1]["metrics"]["method"] == "auto"
    assert texts(first[2])[0] == texts(first[1])[0]
    for n in (1, 2):
        assert texts(ask(server, seed=9, n=n)) == texts(first[n]), n
    for seed in range(3):  # other traffic: answers to this chat, now in the suffix cache
        ask(server, seed=seed, n=2)
    for n in (1, 2):
        assert texts(ask(server, seed=9, n=n)) == texts(first[n]), n
    assert texts(ask(server, seed=9, n=2, speculative={"method": "none"})) == texts(first[2])
