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
            np.testing.assert_array_equal(race_torch.field(key, vocab).numpy(),
                                          race.field(key, vocab))


def test_the_race_is_numpys():
    rng = np.random.default_rng(0)
    for trial in range(30):
        vocab = (100, 600, 5000)[trial % 3]
        p = np.exp(rng.standard_normal(vocab) * 3)
        p[rng.random(vocab) < 0.5] = 0
        p /= p.sum()
        assert race_torch.race(torch.from_numpy(p), trial, trial + 1) == \
            race.race(p, trial, trial + 1), trial
