"""The sampling controls end to end (logit_bias, presence / frequency / repetition penalties,
min_p, and vLLM's masks: min_tokens, allowed_token_ids, bad words) on every method of a tiny engine folder: greedy speculative output equals plain output
under each control, and sampled output follows the reference distribution, the target's with
the control applied at each position to the tokens so far (runtime/sampling.py)."""

import numpy as np
import pytest
from scipy.stats import chisquare

from trt_spec.runtime.generator import Generator
from trt_spec.runtime.sampling import SamplingParams, probs, process_logits
from trt_spec.runtime.scheduler import Scheduler, generate_ids
from trt_spec.runtime.settings import SpeculationConfig
from trt_spec.runtime.step_inputs import SlotTokens

# three tokens of the folder's draft vocabulary (tiny_vocab_engine: the heads draft over 48
# of the 128 ids); the sampled test biases them in p and q alike, so the random heads' drafts
# are accepted often, and repeats them in the prompt, so the lookups find drafts
A, B, C = 16, 28, 40
PROMPT = [5, 17, 99, 3, 17, 99, 3, 17]
CONTROLS = {
    "logit_bias": dict(logit_bias={"40": 4.0, 17: 2.5, 99: -100}),
    "presence_penalty": dict(presence_penalty=1.8),
    "frequency_penalty": dict(frequency_penalty=1.5),
    "repetition_penalty": dict(repetition_penalty=1.3),
    "min_p": dict(min_p=0.1),
    # no end token (EOS, the odd ids) before 3 tokens; then an odd id stops the output
    "min_tokens": dict(min_tokens=3, stop_token_ids=tuple(range(1, 128, 2))),
    "allowed_token_ids": dict(allowed_token_ids=(A, B, C, 5, 17, 42, 61, 99)),
    # C never, B never after A (a two-token word: the row's drafts before it count), and
    # every fourth odd id
    "bad_words": dict(bad_words_ids=((A, B), (C,), *((t,) for t in range(1, 128, 4)))),
}
BIASED_PROMPT = [A, B, C, A, B, C, A, B]
BIAS = {A: 6.0, B: 6.0, C: 6.0}


def methods(engine) -> list[str]:
    return [m for m in Generator(engine, max_len=32).methods if m != "none"]


def speculative(engine, method: str, batch: int) -> Generator:
    """Every step drafts k = 3 (no fallback: the policy would stop a tiny draft that does
    not pay)."""
    return Generator(engine, method=method, max_batch=batch, max_len=32,
                     speculation=SpeculationConfig(num_draft_tokens=3, fallback=False))


@pytest.fixture(scope="module")
def every_method(tiny_vocab_engine):
    return methods(tiny_vocab_engine)


def test_the_folder_has_every_method(every_method):
    assert {"vanilla", "mtp", "eagle", "eagle3", "ngram", "suffix", "hybrid"} <= \
        set(every_method)


@pytest.mark.parametrize("control", CONTROLS)
def test_greedy_speculative_equals_plain_under_each_control(tiny_vocab_engine, every_method,
                                                            control):
    """Greedy: the argmax of the controlled rows, each counting the drafts before it, so every
    method emits plain decoding's tokens; the control does change them."""
    prompts = [PROMPT, [42, 8, 77, 61, 23, 11, 90, 8, 77]]
    params = SamplingParams(max_tokens=16, ignore_eos=True, **CONTROLS[control])
    plain = [s.output_ids for s in generate_ids(Generator(tiny_vocab_engine, max_batch=2,
                                                          max_len=32), prompts, params)]
    if control != "min_p":  # (greedy ignores min-p)
        base = generate_ids(Generator(tiny_vocab_engine, max_batch=2, max_len=32), prompts,
                            SamplingParams(max_tokens=16, ignore_eos=True))
        assert [s.output_ids for s in base] != plain
    for method in every_method:
        streams = generate_ids(speculative(tiny_vocab_engine, method, 2), prompts, params)
        assert [s.output_ids for s in streams] == plain, method


def target_rows(gen: Generator, seqs: list[list[int]]) -> np.ndarray:
    """The target's logits after each sequence [len(seqs), vocab], one forward each."""
    rows = []
    for ids in seqs:
        slot = gen.cache.allocate()
        try:
            rows.append(gen.target.step(gen.cache, [SlotTokens(slot, ids, [len(ids) - 1])])
                        .logits[0][-1])
        finally:
            gen.cache.release(slot)
    return np.stack(rows)


def reference(gen: Generator, params: SamplingParams, n: int, prompt: list[int],
              allowed: list | None = None) -> dict[tuple, float]:
    """The exact distribution of the first n tokens of plain decoding under params (top-k
    bounds its support): each position's target row, teacher-forced, under the controls with
    the tokens before it; allowed[pos]: the tokens a structure allows there (the same at
    every history), the rest masked out."""
    dist = {(): 1.0}
    for pos in range(n):
        seqs = list(dist)
        rows = target_rows(gen, [prompt + list(s) for s in seqs])
        nxt = {}
        for s, row in zip(seqs, rows):
            z = process_logits(row[None], params, prompt, list(s))[0]
            if allowed is not None:
                ids = list(allowed[pos])
                z = np.where(np.isin(np.arange(len(z)), ids), z, -np.inf)
            p = probs(z, params)
            for t in np.flatnonzero(p):
                nxt[s + (int(t),)] = dist[s] * p[t]
        dist = nxt
    return dist


def chi2_pvalue(counts: dict[tuple, int], dist: dict[tuple, float], runs: int) -> float:
    """Pearson's test of observed sequences against the reference; cells expected below 5
    times are pooled."""
    big = [s for s, p in dist.items() if p * runs >= 5]
    assert set(counts) <= set(dist), set(counts) - set(dist)  # never outside the support
    obs = [counts.get(s, 0) for s in big]
    exp = [dist[s] * runs for s in big]
    rest = runs - sum(obs)
    if runs - sum(exp) > 1e-9 * runs:
        obs.append(rest)
        exp.append(runs - sum(exp))
    assert len(obs) > 1, "the reference has one likely sequence: a test with no power"
    return chisquare(obs, exp).pvalue


RUNS = 400  # streams per (method, control): seeds 0..RUNS-1
TOKENS = 3  # the first from prefill, the 2nd and 3rd verified (the 3rd: after d1 when accepted)


@pytest.mark.parametrize("control", CONTROLS)
def test_sampled_output_follows_the_reference_under_each_control(tiny_vocab_engine,
                                                                 every_method, control):
    """Every method's first TOKENS tokens, over RUNS seeds, against the exact distribution of
    plain decoding under the control (Pearson's chi-square: p > 1e-6; a row that misses the
    drafts before it gives p < 1e-10). BIAS on top of each control (logit_bias: with its own
    entries too) makes the drafts hit."""
    extra = CONTROLS[control]
    bias = {**BIAS, **{int(k): v for k, v in extra.get("logit_bias", {}).items()}}
    params = dict(max_tokens=TOKENS, temperature=1.0, top_k=3, ignore_eos=True,
                  **{**extra, "logit_bias": bias})
    plain = Generator(tiny_vocab_engine, max_len=32)
    # (min_tokens holds back the model's EOS too: the engine adds its ids to params)
    dist = reference(plain, plain.with_model_stops(SamplingParams(**params)), TOKENS,
                     BIASED_PROMPT)
    accepted = 0
    for method in ["none"] + every_method:
        gen = speculative(tiny_vocab_engine, method, 16)
        streams = Scheduler(gen).run([gen.stream(BIASED_PROMPT, SamplingParams(seed=i, **params))
                                      for i in range(RUNS)])
        counts = {}
        for s in streams:
            key = tuple(s.output_ids)
            counts[key] = counts.get(key, 0) + 1
        if method != "none":  # its verified rows saw accepted drafts
            assert sum(s.stats.accepted for s in streams) > 0, method
            accepted += sum(s.stats.accepted for s in streams)
        assert chi2_pvalue(counts, dist, RUNS) > 1e-6, (method, control)
    assert accepted > RUNS
