"""runtime/sampling_torch.py against runtime/sampling.py: the same transforms give the same
probabilities for every setting (temperature, top-k, top-p, both, one per row, edge values,
ties), and what the device loop asks of the torch one: greedy rows, seeded draws, no branch
on a tensor's values."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from trt_spec.runtime import sampling_torch as st  # noqa: E402
from trt_spec.runtime.sampling import probs_from_logits  # noqa: E402

V = 97
SETTINGS = [  # (temperature, top_k, top_p)
    (1.0, 0, 1.0),  # plain softmax
    (0.3, 0, 1.0), (2.5, 0, 1.0),  # temperature only
    (1.0, 1, 1.0), (1.0, 7, 1.0), (0.7, V - 1, 1.0),  # top-k
    (1.0, V, 1.0), (1.0, V + 50, 1.0),  # top-k >= vocab: off
    (1.0, 0, 0.9), (0.8, 0, 0.5), (1.0, 0, 1e-3),  # top-p (1e-3: the argmax only)
    (0.7, 20, 0.8), (1.3, 5, 0.95), (0.5, 1, 0.3), (1.0, V + 1, 0.6),  # both
]


def torch_probs(logits: np.ndarray, temperature, top_k, top_p) -> np.ndarray:
    """logits [B, R, V]; settings: one per row (lists) or one for all -> probs [B, R, V]."""
    b = logits.shape[0]
    rows = [np.broadcast_to(np.asarray(s), (b,)) for s in (temperature, top_k, top_p)]
    t, k, p = (torch.from_numpy(np.array(r)) for r in rows)
    return st.probs_from_logits(torch.from_numpy(logits), t, k, p).numpy()


def numpy_probs(logits: np.ndarray, temperature, top_k, top_p) -> np.ndarray:
    b = logits.shape[0]
    rows = [np.broadcast_to(np.asarray(s), (b,)) for s in (temperature, top_k, top_p)]
    return np.stack([probs_from_logits(logits[i], float(rows[0][i]), int(rows[1][i]),
                                       float(rows[2][i])) for i in range(b)])


@pytest.mark.parametrize("shape", [(1, 1, V), (3, 4, V), (5, 2, V)], ids=str)
@pytest.mark.parametrize("setting", SETTINGS, ids=str)
def test_torch_equals_numpy(setting, shape):
    """In float64 the two agree to rounding and keep the same tokens; in float32 (what the
    device runs) to float32 rounding."""
    logits = np.random.default_rng(sum(shape)).normal(0, 3, shape)
    want = numpy_probs(logits, *setting)
    got = torch_probs(logits, *setting)
    np.testing.assert_array_equal(got > 0, want > 0)
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-15)
    got32 = torch_probs(logits.astype(np.float32), *setting)
    assert got32.dtype == np.float32
    np.testing.assert_array_equal(got32 > 0, want > 0)
    np.testing.assert_allclose(got32, want, rtol=1e-5, atol=1e-7)


def test_one_setting_per_row():
    """Rows of one batch each take their own settings."""
    logits = np.random.default_rng(1).normal(0, 2, (len(SETTINGS), 3, V))
    t, k, p = (list(c) for c in zip(*SETTINGS))
    np.testing.assert_allclose(torch_probs(logits, t, k, p), numpy_probs(logits, t, k, p),
                               rtol=1e-12, atol=1e-15)


def test_off_settings_equal_no_filter():
    """top_k 0 (or >= vocab) and top_p 1 change nothing, bit for bit: the same as skipping
    the filters (None), and no tail token is dropped however small (float32, peaked logits:
    the mass before the tail rounds to 1)."""
    logits = torch.randn(4, 3, V, generator=torch.Generator().manual_seed(0)) * 4
    t = torch.tensor([1.0, 0.5, 1.0, 2.0])
    plain = st.probs_from_logits(logits, t)
    off = st.probs_from_logits(logits, t, torch.tensor([0, V, V + 9, 0]), torch.ones(4))
    assert torch.equal(off, plain)
    assert torch.equal(plain, torch.softmax(logits / t[:, None, None], -1))
    assert (plain > 0).all() and (plain < 1e-7).any()  # the tail is there, and tiny


def test_ties():
    """Integer logits tie often. Top-k keeps every token tied with the k-th in both. Top-p
    keeps sets of the same size and mass; when equal tokens straddle its boundary, which of
    them stays is topk's order in torch (NumPy: the lower index first)."""
    logits = np.round(np.random.default_rng(2).normal(0, 1.5, (6, 4, 40)))
    for k in (1, 3, 5, 11):
        want = numpy_probs(logits, 1.0, k, 1.0)
        assert ((want > 0).sum(-1) > k).any()  # ties past the k-th really occur
        np.testing.assert_allclose(torch_probs(logits, 1.0, k, 1.0), want, rtol=1e-12)
    for k, p in ((0, 0.5), (0, 0.9), (4, 0.7), (9, 0.95)):
        want, got = numpy_probs(logits, 0.9, k, p), torch_probs(logits, 0.9, k, p)
        np.testing.assert_allclose(np.sort(got, -1), np.sort(want, -1), rtol=1e-12)
    exact = np.log(np.array([[[0.4, 0.4, 0.1, 0.1]]]))  # both 0.4s stay, both 0.1s go
    np.testing.assert_allclose(torch_probs(exact, 1.0, 0, 0.75), [[[0.5, 0.5, 0, 0]]])


def test_masked_logits():
    """-inf logits (tokens already ruled out) stay at probability 0, under every filter, even
    when fewer than k tokens are left."""
    logits = np.random.default_rng(3).normal(0, 2, (2, 2, 30))
    logits[..., ::3] = -np.inf
    for setting in ((1.0, 0, 1.0), (0.7, 25, 1.0), (1.0, 4, 0.8), (1.0, 0, 0.5)):
        want = numpy_probs(logits, *setting)
        np.testing.assert_allclose(torch_probs(logits, *setting), want, rtol=1e-12, atol=0)
        assert (want[..., ::3] == 0).all()


def test_sample_greedy_rows_and_seeded_draws():
    """Greedy rows take the argmax with one-hot probabilities; the others draw from
    probs_from_logits; a seeded generator repeats the draws; filtered=False is the same as
    settings that filter nothing."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 2, V, generator=g) * 3
    temp = torch.tensor([0.8, 1.0, 1.3, 1.0])
    greedy = torch.tensor([False, True, False, True])
    top_k, top_p = torch.tensor([5, 5, 0, 0]), torch.tensor([1.0, 0.5, 0.9, 1.0])
    draw = lambda seed, *a: st.sample(logits, temp, top_k, top_p, greedy, *a,  # noqa: E731
                                      generator=torch.Generator().manual_seed(seed))
    tokens, probs = draw(1)
    assert torch.equal(tokens[greedy], logits[greedy].argmax(-1))
    assert torch.equal(probs[greedy], torch.nn.functional.one_hot(tokens[greedy], V).float())
    want = st.probs_from_logits(logits[~greedy], temp[~greedy], top_k[~greedy], top_p[~greedy])
    assert torch.equal(probs[~greedy], want)
    assert (probs.gather(-1, tokens[..., None]) > 0).all()  # a drawn token has mass
    assert all(torch.equal(a, b) for a, b in zip(draw(1), draw(1)))
    unfiltered = st.sample(logits, temp, top_k * 0, top_p * 0 + 1, greedy, True,
                           torch.Generator().manual_seed(2))
    assert all(torch.equal(a, b) for a, b in zip(draw(2, False), unfiltered))


def test_sampled_frequencies_follow_the_probabilities():
    n, vocab = 40000, 6
    logits = torch.randn(1, 1, vocab, generator=torch.Generator().manual_seed(4)).expand(n, 1, -1)
    t, k, p = torch.full((n,), 0.9), torch.full((n,), 4), torch.full((n,), 0.95)
    tokens, probs = st.sample(logits, t, k, p, torch.zeros(n, dtype=torch.bool),
                              generator=torch.Generator().manual_seed(5))
    freq = torch.bincount(tokens[:, 0], minlength=vocab).double() / n
    assert (freq - probs[0, 0].double()).abs().max() < 0.01, (freq, probs[0, 0])


def test_no_branch_on_tensor_values():
    """torch.export traces the transforms with a symbolic batch and no guard on a value: no
    host sync, no Python branch on a tensor (what CUDA-graph capture needs too)."""

    class Probs(torch.nn.Module):
        def forward(self, logits, temperature, greedy, top_k, top_p):
            t = st.temperature_or_one(temperature, greedy)
            return st.probs_from_logits(logits, t, top_k, top_p)

    b = torch.export.Dim("batch", min=2, max=64)
    args = (torch.randn(3, 2, V), torch.ones(3), torch.zeros(3, dtype=torch.bool),
            torch.tensor([0, 5, 9]), torch.tensor([1.0, 0.9, 0.5]))
    program = torch.export.export(Probs(), args, dynamic_shapes=({0: b}, {0: b}, {0: b}, {0: b},
                                                                  {0: b}))
    again = (torch.randn(5, 2, V), torch.rand(5) + 0.5, torch.tensor([1, 0, 0, 1, 0]).bool(),
             torch.tensor([0, 3, 200, 1, 7]), torch.tensor([0.3, 1.0, 0.8, 1.0, 0.99]))
    assert torch.equal(program.module()(*again), Probs()(*again))


@pytest.mark.parametrize("min_p", [0.0, 0.02, 0.3, 1.0])
@pytest.mark.parametrize("setting", [(1.0, 0, 1.0), (0.7, 20, 0.8), (1.3, 5, 0.95)], ids=str)
def test_min_p_torch_equals_numpy(setting, min_p):
    """min-p sits between the temperature and top-k in both (1.0: only the argmax and its
    ties stay)."""
    from trt_spec.runtime.sampling import SamplingParams, probs

    t, k, p = setting
    logits = np.random.default_rng(5).normal(0, 3, (3, 4, V))
    params = SamplingParams(temperature=t, top_k=k, top_p=p, min_p=min_p)
    want = np.stack([probs(row, params) for row in logits])
    f64 = lambda x: torch.full((3,), x, dtype=torch.float64)  # noqa: E731
    got = st.probs_from_logits(torch.from_numpy(logits), f64(t), torch.full((3,), k), f64(p),
                               f64(min_p)).numpy()
    np.testing.assert_array_equal(got > 0, want > 0)
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-15)
    if min_p and k == 0:
        kept = (want > 0).sum(-1)
        assert (kept < (numpy_probs(logits, t, k, p) > 0).sum(-1)).any()  # it drops tokens


def test_process_logits_torch_equals_numpy():
    """logit_bias and the penalties, one setting per batch row, each verified row counting
    the output so far and the drafts before it: the torch twin (dense counts, row_counts)
    gives what runtime/sampling.py's process_logits gives."""
    from trt_spec.runtime.sampling import SamplingParams, process_logits

    rng = np.random.default_rng(6)
    k = 3
    params = [SamplingParams(logit_bias={3: 5.0, 50: -100}, repetition_penalty=1.0),
              SamplingParams(presence_penalty=1.5, frequency_penalty=-0.5),
              SamplingParams(repetition_penalty=1.7),
              SamplingParams(logit_bias={0: -2.5}, presence_penalty=-1.0, frequency_penalty=2.0,
                             repetition_penalty=0.6)]
    b = len(params)
    logits = rng.normal(0, 3, (b, k + 1, V))
    prompts = [rng.integers(0, V, 6).tolist() for _ in range(b)]
    outputs = [rng.integers(0, 12, n).tolist() for n in (0, 5, 9, 14)]  # repeats among few ids
    drafts = rng.integers(0, 12, (b, k))
    want = np.stack([process_logits(logits[i], params[i], prompts[i], outputs[i], drafts[i])
                     for i in range(b)])
    bias = torch.zeros(b, V, dtype=torch.float64)
    for i, p in enumerate(params):
        for t, x in p.logit_bias:
            bias[i, t] = x
    output_counts = torch.stack([torch.bincount(torch.tensor(o, dtype=torch.long), minlength=V)
                                 for o in outputs])
    seen = torch.zeros(b, V, dtype=torch.bool)
    for i, p in enumerate(prompts):
        seen[i, p] = True
    setting = lambda name: torch.tensor([getattr(p, name) for p in params],  # noqa: E731
                                        dtype=torch.float64)
    got = st.process_logits(torch.from_numpy(logits), bias,
                            st.row_counts(output_counts, torch.from_numpy(drafts)), seen,
                            setting("repetition_penalty"), setting("frequency_penalty"),
                            setting("presence_penalty")).numpy()
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)
    assert not np.allclose(want, logits)  # the controls did change every row
