"""Speculative verification as data: forced argmaxes, edge cases, and distributions; the
exponential race (runtime/race.py) and the drafter-invariant rule built on it; Leviathan's
rule (stochastic_verify: the reference a model drafter's acceptance is compared with)."""

import dataclasses

import numpy as np
import pytest
from scipy.stats import chisquare

from trt_spec.runtime import race as race_mod
from trt_spec.runtime.verify import (PLACEHOLDER, greedy_verify, race_verify,
                                     residual, stochastic_verify, verify_batch)
from trt_spec.runtime.sampling import (NonFiniteError, SamplingParams, check_finite, next_token,
                                       probs, probs_from_logits, process_logits)

V = 8
GREEDY = SamplingParams()


def forced(argmaxes):
    """Logits [len, V] whose argmax at row i is argmaxes[i] (+100 vs -100)."""
    logits = np.full((len(argmaxes), V), -100.0)
    logits[np.arange(len(argmaxes)), argmaxes] = 100.0
    return logits


@pytest.mark.parametrize("k", [1, 2, 4, 8])
@pytest.mark.parametrize("batch", [1, 3])
def test_greedy_accepts_longest_matching_prefix(k, batch):
    rng = np.random.default_rng(k * 10 + batch)
    drafts, logits, expect = [], [], []
    for row in range(batch):
        d = rng.integers(0, V, k)
        a = int(rng.integers(0, k + 1))  # how many should be accepted
        target = list(d[:a]) + [int((d[a] + 1) % V) if a < k else int(rng.integers(0, V))]
        target += list(rng.integers(0, V, k - a))  # positions after a rejection don't matter
        drafts.append(d)
        logits.append(forced(target))
        expect.append((a, target[:a + 1]))
    res = verify_batch(drafts, logits, [GREEDY] * batch, [0] * batch)
    assert res.tokens.shape == (batch, k + 1)
    for row, (a, out) in enumerate(expect):
        assert res.num_accepted[row] == a and res.num_emitted[row] == a + 1
        assert res.tokens[row, :a + 1].tolist() == out
        assert (res.tokens[row, a + 1:] == PLACEHOLDER).all()


def test_rows_with_different_k_and_plain_decode():
    res = verify_batch([np.array([3, 4]), np.array([], dtype=np.int64)],
                       [forced([3, 4, 5]), forced([6])], [GREEDY] * 2, [0, 0])
    assert res.tokens.tolist() == [[3, 4, 5], [6, PLACEHOLDER, PLACEHOLDER]]
    assert res.num_emitted.tolist() == [3, 1]


def test_p_equal_q_accepts_everything():
    params = SamplingParams(temperature=1.0)
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((5, V))
    q = probs_from_logits(logits[:4], 1.0)
    for _ in range(2000):
        drafts = np.array([rng.choice(V, p=q[i]) for i in range(4)])
        a, out = stochastic_verify(drafts, q, logits, params, rng)
        assert a == 4 and len(out) == 5


def test_residual_without_mass_falls_back_to_p():
    p = np.array([0.5, 0.5, 0.0])
    np.testing.assert_allclose(residual(p, p.copy(), 0), p)
    np.testing.assert_allclose(residual(np.array([1.0, 0, 0]), None, 0), [1.0, 0, 0])
    r = residual(np.array([0.6, 0.4, 0.0]), None, 0)
    np.testing.assert_allclose(r, [0, 1, 0])


def test_seeded_stochastic_is_deterministic():
    params = SamplingParams(temperature=0.8, top_k=5, seed=11)
    logits = np.random.default_rng(1).standard_normal((4, V))
    q = probs_from_logits(np.random.default_rng(2).standard_normal((3, V)), 0.8, 5)
    run = lambda: stochastic_verify(np.array([1, 2, 3]), q, logits, params,
                                    np.random.default_rng(params.seed))
    assert run() == run()


def tv(counts, p):
    return 0.5 * np.abs(counts / counts.sum() - p).sum()


N = 200_000
TV_BOUND = 0.01  # expected TV at N = 200k and V = 8 is ~0.003; 0.01 is > 3x that


def cases():
    rng = np.random.default_rng(42)
    p_logits = rng.standard_normal(V) * 2
    p1_logits = rng.standard_normal((V, V)) * 2  # target at position 1, given token 0
    yield "q near p", p_logits, p_logits + rng.standard_normal(V) * 0.3, p1_logits, SamplingParams(temperature=1.0)
    yield "q much worse", p_logits, -p_logits, p1_logits, SamplingParams(temperature=1.0)
    disjoint_q = np.where(np.arange(V) < V // 2, -100.0, 0.0)
    disjoint_p = np.where(np.arange(V) < V // 2, 0.0, -100.0)
    yield "disjoint supports", disjoint_p, disjoint_q, p1_logits, SamplingParams(temperature=1.0)
    yield "top-k 3", p_logits, rng.standard_normal(V), p1_logits, SamplingParams(temperature=0.7, top_k=3)
    yield "top-p 0.8", p_logits, rng.standard_normal(V), p1_logits, SamplingParams(temperature=1.3, top_p=0.8)
    yield "deterministic drafter", p_logits, None, p1_logits, SamplingParams(temperature=1.0)
    # structured outputs: the target's rows masked by a grammar (-inf where it forbids), the
    # drafter's not, so drafts the grammar forbids reach verification (the engine keeps the
    # first of them): rejected for certain, that position drawn from the residual
    masked_p = np.where(np.isin(np.arange(V), [0, 2, 5]), -np.inf, p_logits)
    masked_p1 = np.where((np.arange(V)[None, :] + np.arange(V)[:, None]) % 3 == 0, -np.inf,
                         p1_logits)
    yield "grammar mask", masked_p, rng.standard_normal(V), masked_p1, SamplingParams(temperature=1.0)
    yield "grammar mask, top-p", masked_p, rng.standard_normal(V), masked_p1, SamplingParams(temperature=0.8, top_p=0.9)
    # the sampling controls (runtime/sampling.py), on p and q alike, each row counting the
    # output so far (OUTPUT) and the drafts before it: the second position's row sees d1
    q_logits = rng.standard_normal(V)
    yield "logit_bias", p_logits, q_logits, p1_logits, SamplingParams(temperature=1.0, logit_bias={2: 3.0, 6: -100, 7: 1.5})
    yield "presence_penalty", p_logits, q_logits, p1_logits, SamplingParams(temperature=1.0, presence_penalty=1.5)
    yield "frequency_penalty", p_logits, q_logits, p1_logits, SamplingParams(temperature=0.9, frequency_penalty=2.0)
    yield "negative frequency_penalty", p_logits, None, p1_logits, SamplingParams(temperature=1.0, frequency_penalty=-1.0)
    yield "repetition_penalty", p_logits, q_logits, p1_logits, SamplingParams(temperature=1.0, repetition_penalty=1.8)
    yield "min_p", p_logits, q_logits, p1_logits, SamplingParams(temperature=1.2, min_p=0.15)
    yield "every control, top-k, grammar mask", masked_p, q_logits, masked_p1, SamplingParams(
        temperature=0.8, top_k=5, logit_bias={1: 2.0}, presence_penalty=0.5, frequency_penalty=0.7,
        repetition_penalty=1.3, min_p=0.05)


PROMPT, OUTPUT = [1, 3], [3, 5, 3]  # what the penalties count before the verified rows


@pytest.mark.parametrize("name, p_logits, q_logits, p1_logits, params", list(cases()),
                         ids=[c[0] for c in cases()])
def test_emitted_tokens_follow_the_target_distribution(name, p_logits, q_logits, p1_logits, params):
    """First emitted token ~ p; second (given the first was an accepted draft y) ~ p1[y]: each
    as plain decoding draws it, under the request's controls with its own context (OUTPUT;
    OUTPUT + [y]). The verifier's rows come from process_logits over [last, d1, d2], the
    drafter's q from the same controls with the drafts before it, as the engine makes them."""
    def dist(logits, output):  # one position's distribution, as plain decoding draws it
        return probs(process_logits(logits[None], params, PROMPT, output)[0], params)

    p0 = dist(p_logits, OUTPUT)
    q0 = None if q_logits is None else dist(q_logits, OUTPUT)
    q1_logits = np.roll(p1_logits, 1, axis=1)  # the draft's 2nd position: off by one token
    rng = np.random.default_rng(0)
    q1 = [None if q0 is None else dist(q1_logits[y], OUTPUT + [y]) for y in range(V)]
    p1_argmax = p1_logits.argmax(-1)
    rows = {}  # (d1, d2) -> the target's rows [last, d1, d2] as the engine verifies them
    # the drafts, drawn up front (vectorized); the verifier runs once per trial
    d1s = np.full(N, int(np.argmax(p0))) if q0 is None else rng.choice(V, size=N, p=q0)
    u = rng.random(N)
    first = np.zeros(V)
    second = {y: np.zeros(V) for y in range(V)}
    for d1, ui in zip(d1s.tolist(), u.tolist()):
        if q0 is None:
            d2, q = int(p1_argmax[d1]), None
        else:
            d2 = min(int(np.searchsorted(np.cumsum(q1[d1]), ui, side="right")), V - 1)
            q = np.stack([q0, q1[d1]])
        if (d1, d2) not in rows:
            rows[d1, d2] = process_logits(np.stack([p_logits, p1_logits[d1], p_logits]), params,
                                          PROMPT, OUTPUT, [d1, d2])
        a, out = stochastic_verify(np.array([d1, d2]), q, rows[d1, d2], params, rng)
        first[out[0]] += 1
        if a >= 1:
            second[out[0]][out[1]] += 1
    assert first[p0 == 0].sum() == 0
    assert tv(first, p0) < TV_BOUND, (name, first / N, p0)
    for y, counts in second.items():
        if counts.sum() < 20_000:
            continue  # too few draws of this prefix for a tight bound
        p1 = dist(p1_logits[y], OUTPUT + [y])
        assert counts[p1 == 0].sum() == 0
        assert tv(counts, p1) < 2.5 * TV_BOUND, (name, y, counts / counts.sum(), p1)


# --- the exponential race (runtime/race.py): sampling keyed by (seed, position) ------------

def full_race(p: np.ndarray, seed: int, position: int) -> int:
    """argmin E / p over the whole field, drawn whole (what race must equal)."""
    e = race_mod.field(race_mod.row_key(seed, position), len(p))
    with np.errstate(divide="ignore"):
        return int(np.argmin(np.where(p > 0, e / np.where(p > 0, p, 1.0), np.inf)))


@pytest.mark.parametrize("vocab", [7, 300, 5000])
@pytest.mark.parametrize("sparse", [True, False])
def test_race_is_the_whole_fields_race(vocab, sparse, monkeypatch):
    """Only ids that can win are drawn (few ids with weight; else the blocks whose bound beats
    the best time): the winner is the whole field's, over peaked, flat and cut p."""
    monkeypatch.setattr(race_mod, "SPARSE", vocab if sparse else 0)
    rng = np.random.default_rng(vocab)
    for trial in range(40):
        p = np.exp(rng.standard_normal(vocab) * (0.5, 3, 8)[trial % 3])
        p[rng.random(vocab) < (0, 0.5, 0.95)[trial % 3]] = 0
        if not p.any():
            p[trial % vocab] = 1
        p /= p.sum()
        assert race_mod.race(p, trial, trial * 3) == full_race(p, trial, trial * 3), trial


def test_race_draws_each_token_at_its_weight_across_blocks(monkeypatch):
    """Over seeds, the race's frequencies are p's (chi-square), through the blocks' path
    (3 blocks of 256, the last shorter)."""
    monkeypatch.setattr(race_mod, "SPARSE", 0)
    vocab = 600
    p = np.zeros(vocab)
    p[[3, 200, 255, 256, 400, 599]] = [0.3, 0.1, 0.05, 0.25, 0.2, 0.1]
    draws = np.bincount([race_mod.race(p, seed, 0) for seed in range(20000)], minlength=vocab)
    assert draws[p == 0].sum() == 0
    assert chisquare(draws[p > 0], 20000 * p[p > 0]).pvalue > 1e-6


def test_race_noise_is_pinned():
    """splitmix64's finalizer, as a torch twin must reproduce it bit for bit (a change here
    changes every seeded output)."""
    assert race_mod.mix(0x9E3779B97F4A7C15) == 0xE220A8397B1DCDAF  # splitmix64(0)'s first
    z = np.array([0, 1, 2**63, 2**64 - 1], dtype=np.uint64)
    assert race_mod.mix_array(z).tolist() == [race_mod.mix(int(x)) for x in z]
    key = race_mod.row_key(5, 3)
    assert key == 0xCD56B8B8726D3927
    assert race_mod.hashes(key, np.arange(3), 2).tolist() == [
        15770577530034542605, 2934192898899368097, 4910066732917116557]


@pytest.mark.parametrize("name, p_logits, q_logits, p1_logits, params", list(cases()),
                         ids=[c[0] for c in cases()])
def test_race_verify_emits_plain_decodings_tokens(name, p_logits, q_logits, p1_logits, params):
    """For every seed: the drafts drawn as the engine draws them (the race of the same seed
    over q, or a deterministic drafter's argmax), verified, give exactly the tokens plain
    decoding draws at those positions; a model draft is accepted at least as often as the
    coupling's bound (1 - TV) / (1 + TV) allows, less a margin."""
    def dist(logits, output):
        return probs(process_logits(logits[None], params, PROMPT, output)[0], params)

    at = len(OUTPUT)  # the output position of the first verified row
    p0 = dist(p_logits, OUTPUT)
    accepted, seeds = 0, 3000
    for seed in range(seeds):
        sp = dataclasses.replace(params, seed=seed)
        if q_logits is None:
            d1 = int(np.argmax(p0))
        else:
            d1 = race_mod.race(dist(q_logits, OUTPUT), seed, at)
        d2 = int(np.argmax(p1_logits[d1]))
        rows = process_logits(np.stack([p_logits, p1_logits[d1], p_logits]), params, PROMPT,
                              OUTPUT, [d1, d2])
        a, out = race_verify(np.array([d1, d2]), rows, sp, at)
        t0 = next_token(process_logits(p_logits[None], params, PROMPT, OUTPUT)[0], sp, at)
        assert out[0] == t0, (name, seed)
        if a >= 1:
            t1 = next_token(process_logits(p1_logits[d1][None], params, PROMPT,
                                           OUTPUT + [d1])[0], sp, at + 1)
            assert out[1] == t1, (name, seed)
        accepted += a >= 1
    if q_logits is not None:
        d = 0.5 * np.abs(p0 - dist(q_logits, OUTPUT)).sum()
        assert accepted / seeds > (1 - d) / (1 + d) - 0.03, (name, accepted / seeds, d)


def all_rows_greedy(drafts, logits):
    """The reference: every row's argmax, the longest prefix of drafts equal to it, then the
    argmax after it."""
    target = logits.argmax(-1)
    a = next((i for i, d in enumerate(drafts) if d != target[i]), len(drafts))
    return a, [int(t) for t in drafts[:a]] + [int(target[a])]


def test_greedy_verify_is_the_argmax_prefix_with_check_finite_on_the_rows_it_reads():
    """The one-pass greedy verification: the same (accepted, tokens) as check_finite then
    every row's argmax wherever the rows are finite; a NaN or +inf in a row it reads raises
    as check_finite does, in a row past the first mismatch (never read) it does not; a row
    all -inf (a grammar's dead end) passes."""
    rng = np.random.default_rng(11)
    for _ in range(200):
        k = int(rng.integers(0, 6))
        logits = rng.standard_normal((k + 1, V)).astype(np.float32)
        target = logits.argmax(-1)
        drafts = np.where(rng.random(k) < 0.7, target[:k], rng.integers(0, V, k))
        a, out = all_rows_greedy(drafts, check_finite(logits, "x"))
        assert greedy_verify(drafts, logits) == (a, out)
    logits = forced([3, 5, 1])
    drafts = np.array([3, 4])  # row 1 rejects: row 2 is never read
    for bad in (np.nan, np.inf):
        late = logits.copy()
        late[2, 0] = bad
        assert greedy_verify(drafts, late) == (1, [3, 5])
        read = logits.copy()
        read[1, 6] = bad
        with pytest.raises(NonFiniteError):
            greedy_verify(drafts, read)
    dead = np.full((1, V), -np.inf)
    assert greedy_verify(np.array([], np.int64), dead) == (0, [0])
