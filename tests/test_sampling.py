import numpy as np
import pytest

from trt_spec.runtime.sampling import SamplingParams, next_token, probs_from_logits


def test_top_k_keeps_k_largest():
    p = probs_from_logits(np.array([[1.0, 3.0, 2.0, 0.0]]), 1.0, top_k=2)[0]
    assert p[0] == 0 and p[3] == 0
    np.testing.assert_allclose(p[1] / p[2], np.e)


def test_top_p_keeps_smallest_set_reaching_p():
    logits = np.log(np.array([0.5, 0.3, 0.15, 0.05]))
    p = probs_from_logits(logits, 1.0, top_p=0.75)
    np.testing.assert_allclose(p, [0.5 / 0.8, 0.3 / 0.8, 0, 0])
    # the most likely token always survives, however small p is
    np.testing.assert_allclose(probs_from_logits(logits, 1.0, top_p=0.01), [1, 0, 0, 0])


def test_temperature_sharpens():
    logits = np.array([1.0, 2.0])
    assert probs_from_logits(logits, 0.5)[1] > probs_from_logits(logits, 1.0)[1]


def test_greedy_is_argmax():
    logits = np.full(50, -100.0)
    logits[17] = 100.0
    assert next_token(logits, SamplingParams(), 0) == 17


def test_seeded_sampling_is_reproducible_and_matches_distribution():
    """A token is a function of (seed, position) and p: the same again; over positions (or
    seeds) its frequencies are p's."""
    logits = np.log(np.array([0.1, 0.2, 0.3, 0.4]))
    params = SamplingParams(temperature=1.0, seed=3)
    assert [next_token(logits, params, i) for i in range(50)] == \
        [next_token(logits, params, i) for i in range(50)]
    counts = np.bincount([next_token(logits, params, i) for i in range(20000)], minlength=4)
    np.testing.assert_allclose(counts / counts.sum(), [0.1, 0.2, 0.3, 0.4], atol=0.015)


@pytest.mark.parametrize("kwargs, message", [
    ({"max_tokens": -1}, "max_tokens=-1"),
    ({"prompt_logprobs": 21}, "prompt_logprobs=21: must be an integer in 0..20"),
    ({"temperature": -1.0}, "temperature=-1.0"),
    ({"temperature": float("nan")}, "temperature=nan"),
    ({"top_p": 0.0}, r"top_p=0.0: must be a finite number in 1e-20..1 \(1 = off"),
    ({"top_p": 1.5}, "top_p=1.5"),
    ({"top_k": -1}, "top_k=-1"),
    ({"stop": ("",)}, "stop strings must be non-empty"),
    ({"n": 0}, "n=0: must be an integer >= 1"),
    ({"logit_bias": {"12": 101}}, r"logit_bias\[12\]=101: must be a finite number in -100..100"),
    ({"logit_bias": {"x": 1}}, "logit_bias key 'x': expected a token id"),
    ({"logit_bias": {-3: 1}}, "logit_bias key -3"),
    ({"logit_bias": [1, 2]}, "logit_bias=.*expected an object of token id -> bias"),
    ({"presence_penalty": 2.5}, r"presence_penalty=2.5: must be a finite number in -2..2"),
    ({"frequency_penalty": -3}, "frequency_penalty=-3"),
    ({"repetition_penalty": 0.0}, r"repetition_penalty=0.0: must be a finite number in 1e-20..1e20 \(1 = off"),
    ({"min_p": 1.5}, r"min_p=1.5: must be a finite number in 0..1"),
])
def test_bad_params_are_refused_with_the_value(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_sample_from_probs_draws_each_token_at_its_weight():
    """The two-level inverse CDF: frequencies match the weights (normalized or not, a vocabulary
    not a multiple of the block), a zero weight is never drawn, a seed repeats the draws."""
    from trt_spec.runtime.sampling import SAMPLE_BLOCK, sample_from_probs

    rng = np.random.default_rng(1)
    n = 3 * SAMPLE_BLOCK + 37
    w = rng.random(n) ** 4 * 5.0  # unnormalized, uneven
    w[::3] = 0.0
    w[-1] = 0.0  # the last token, which rounding past a block's end would otherwise pick
    draws = np.array([sample_from_probs(w, rng) for _ in range(40000)])
    assert not np.any(w[draws] == 0)
    # block by block (per-token counts are too small at this vocabulary)
    blocks = np.add.reduceat(w, np.arange(0, n, 64)) / w.sum()
    freq = np.bincount(draws // 64, minlength=len(blocks)) / len(draws)
    np.testing.assert_allclose(freq, blocks, atol=0.01)
    a = [sample_from_probs(w, np.random.default_rng(7)) for _ in range(3)]
    assert a == [sample_from_probs(w, np.random.default_rng(7)) for _ in range(3)]
    one_hot = np.zeros(n)
    one_hot[SAMPLE_BLOCK + 5] = 1e-30  # a single tiny weight is still certain
    assert {sample_from_probs(one_hot, rng) for _ in range(20)} == {SAMPLE_BLOCK + 5}


def test_logit_bias_keys_as_json_sends_them():
    """Keys may be decimal strings ("1234", as JSON has them) or ints; kept as sorted pairs."""
    p = SamplingParams(logit_bias={"7": 1, 3: -100.0, "12": 0.5})
    assert p.logit_bias == ((3, -100.0), (7, 1.0), (12, 0.5))
    assert SamplingParams(logit_bias=p.logit_bias) == p
    assert p.controls == ("logit_bias",) and p.processes_logits
    assert SamplingParams().controls == () and not SamplingParams().processes_logits
    assert SamplingParams(min_p=0.1).controls == ("min_p",)
    assert not SamplingParams(min_p=0.1).processes_logits  # min-p is in probs_from_logits


def test_process_logits_follows_the_definitions():
    """OpenAI's frequency and presence penalties over the output so far, vLLM's repetition
    penalty over prompt and output, logit_bias first; row j also counts drafts[:j]."""
    from trt_spec.runtime.sampling import process_logits

    logits = np.array([[2.0, -1.0, 0.5, 3.0, -2.0]] * 3)
    prompt, output, drafts = [4], [0, 0, 2], [3, 0]
    p = SamplingParams(logit_bias={1: 4.0}, frequency_penalty=0.5, presence_penalty=0.25,
                       repetition_penalty=2.0)
    z = process_logits(logits, p, prompt, output, drafts)
    # row 0: counts {0: 2, 2: 1}; repetition on 0, 2 (output) and 4 (prompt)
    np.testing.assert_allclose(z[0], [2 / 2 - 0.5 * 2 - 0.25, 3.0, 0.5 / 2 - 0.5 - 0.25, 3.0,
                                      -2 * 2])
    # row 1 counts d1 = 3 too; row 2 counts d1 and d2 = 0
    np.testing.assert_allclose(z[1, 3], 3 / 2 - 0.5 - 0.25)
    np.testing.assert_allclose(z[2, 0], 2 / 2 - 0.5 * 3 - 0.25)
    assert process_logits(logits, SamplingParams(), prompt, output, drafts) is logits  # off
    single = process_logits(logits[:1], p, prompt, output + drafts[:1])  # plain decoding's row
    np.testing.assert_allclose(single[0], z[1])


def test_min_p_keeps_tokens_at_least_min_p_times_the_top():
    logits = np.log(np.array([0.5, 0.3, 0.15, 0.05]))
    np.testing.assert_allclose(probs_from_logits(logits, 1.0, min_p=0.2), [0.5 / 0.95,
                               0.3 / 0.95, 0.15 / 0.95, 0])
    np.testing.assert_allclose(probs_from_logits(logits, 1.0, min_p=1.0), [1, 0, 0, 0])
