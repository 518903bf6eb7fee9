"""CUDA-graph shape buckets (runtime/backends/buckets.py), shared by the torch-cuda and trt
backends: which bucket a step lands in, and what padding it gets."""

import numpy as np
import pytest

from trt_spec.runtime.backends.buckets import Bucket, pad_feeds, plan_bucket, round_up


@pytest.mark.parametrize("n,want", [(1, 1), (5, 5), (9, 12), (32, 32), (33, None)])
def test_round_up(n, want):
    assert round_up(n, (1, 2, 3, 4, 5, 6, 7, 8, 12, 16, 24, 32)) == want


@pytest.mark.parametrize("lo,hi,slots,want_lo,want_batch", [
    (0, 1, 8, 0, 1),  # one stream in slot 0
    (2, 5, 8, 2, 4),  # 3 slots -> 4, starting where the step starts
    (6, 8, 8, 6, 2),
    (5, 8, 8, 4, 4),  # 3 -> 4 would run past the cache: shifted down
    (0, 3, 3, 0, 3),  # capped at the cache's slots
])
def test_plan_bucket_batch(lo, hi, slots, want_lo, want_batch):
    b = plan_bucket(lo, hi, 5, 5, slots, hidden=False)
    assert (b.lo, b.batch, b.new_tokens, b.num_logits) == (want_lo, want_batch, 5, 5)
    assert b.lo <= lo and hi <= b.hi <= slots


def test_long_prefill_has_no_bucket():
    assert plan_bucket(0, 1, 100, 1, 4, hidden=False) is None


def test_pad_feeds():
    """Slots [3, 5) of an 8-slot cache, T=2 -> bucket [2, 6) x T=3, N=4."""
    feeds = {
        "input_ids": np.array([[7, 8], [9, 0]]),
        "position_ids": np.array([[4, 5], [2, 2]]),
        "seqlens_k": np.array([5, 2], dtype=np.int32),
        "query_seqlens": np.array([2, 1], dtype=np.int32),
        "total_sequence_length": np.array(6, dtype=np.int32),
        "logits_index": np.array([[0, 1], [0, 0]]),
        "hidden_states": np.ones((2, 2, 3), dtype=np.float32),
    }
    lengths = np.array([0, 0, 9, 4, 2, 0, 0, 0])
    out = pad_feeds(feeds, lengths, 3, Bucket(2, 4, 3, 4, True))
    assert out["input_ids"].tolist() == [[0, 0, 0], [7, 8, 0], [9, 0, 0], [0, 0, 0]]
    assert out["position_ids"].tolist() == [[0, 0, 0], [4, 5, 5], [2, 2, 2], [0, 0, 0]]
    assert out["seqlens_k"].tolist() == [8, 5, 2, 0]  # idle rows keep length - 1
    assert out["query_seqlens"].tolist() == [0, 2, 1, 0]  # idle rows: nothing to do
    assert int(out["total_sequence_length"]) == 9
    assert out["logits_index"].tolist() == [[0] * 4, [0, 1, 0, 0], [0] * 4, [0] * 4]
    assert out["hidden_states"].shape == (4, 3, 3) and out["hidden_states"].sum() == 12
