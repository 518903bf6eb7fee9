"""runtime/race_torch.py reproduces runtime/race.py bit for bit (CPU torch): the hashes, the
field, and the race's winner."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from trt_spec.runtime import race, race_torch  # noqa: E402


def test_the_hashes_and_the_field_are_bit_for_bit_numpys():
    ids = np.array([0, 1, 2, 255, 256, 49151, 2**40 + 7], dtype=np.int64)
    for seed, position in ((0, 0), (5, 3), (2**64 - 1, 10**6)):
        key = race.row_key(seed, position)
        for level in range(race.LEVELS):
            want = race.hashes(key, ids, level)
            got = race_torch.hashes(key, torch.from_numpy(ids), level).numpy().view(np.uint64)
            assert got.tolist() == want.tolist(), (seed, position, level)
        for vocab in (7, 600, 49152):
            got = race_torch.field_at(key, torch.arange(vocab), vocab)  # the whole field
            np.testing.assert_array_equal(got.numpy(), race.field(key, vocab))


def test_the_race_is_numpys():
    """race_logits over one row's log p (a zero weight: -inf, ruled out) is race.race."""
    rng = np.random.default_rng(0)
    for trial in range(30):
        vocab = (100, 600, 5000)[trial % 3]
        p = np.exp(rng.standard_normal(vocab) * 3)
        p[rng.random(vocab) < 0.5] = 0
        p /= p.sum()
        with np.errstate(divide="ignore"):
            z = torch.from_numpy(np.log(p)).view(1, 1, vocab)
        won = race_torch.race_logits(z, torch.tensor([trial]), torch.tensor([[trial + 1]]), vocab)
        assert int(won) == race.race(p, trial, trial + 1), trial


def test_batched_keys_and_race_are_numpys():
    """row_keys over a batch of seeds (past 2^63: int64's sign bit) and positions is row_key;
    race_logits, the log-domain race over a row's logits, picks race.race's winner."""
    seeds = [0, 5, 2**63, 2**64 - 1]
    positions = np.array([[0, 1, 2], [7, 8, 9], [0, 100, 10**6], [3, 4, 5]])
    got = race_torch.row_keys(torch.tensor([race_torch.signed(s) for s in seeds]),
                              torch.from_numpy(positions))
    want = [[race_torch.signed(race.row_key(s, int(i))) for i in row]
            for s, row in zip(seeds, positions)]
    assert got.tolist() == want
    rng = np.random.default_rng(1)
    z = rng.standard_normal((4, 3, 700)) * 2
    z[0, 0, rng.random(700) < 0.7] = -np.inf  # a filtered row
    won = race_torch.race_logits(torch.from_numpy(z), torch.tensor(
        [race_torch.signed(s) for s in seeds]), torch.from_numpy(positions), 700)
    for b, s in enumerate(seeds):
        for r in range(3):
            p = np.exp(z[b, r] - z[b, r].max())
            assert won[b, r] == race.race(p / p.sum(), s, int(positions[b, r])), (b, r)
