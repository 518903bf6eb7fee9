"""Shape buckets for CUDA-graph backends (torch-cuda and trt): pure NumPy, no CUDA.

A CUDA graph replays fixed kernels on fixed addresses, so it is valid only for one set of
shapes and one set of buffers. A step of `build_step_inputs` (slots [lo, hi), new_tokens T,
num_logits N) is padded up to a bucket:

    slots      [lo, hi)  ->  [b_lo, b_lo + B)    B from BATCH_SIZES, the range inside the cache
    new_tokens T         ->  Tb                  from TOKEN_SIZES (beyond: no graph, run eagerly)
    num_logits N         ->  Nb                  from TOKEN_SIZES

Padding is what the graph contract already allows: rows of the range with nothing to do are
idle (query_seqlens = 0, their cache untouched), token columns past a row's query_seqlens are
right padding, extra logits_index entries read row 0. The cache views of a bucket
(`[b_lo, b_lo + B)` of every layer) have fixed addresses, so a bucket is keyed by b_lo too.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
# Exact up to 8 (decode, verify with k <= 7, drafter catch-up), coarser after; prefill of a
# longer prompt runs without a graph.
TOKEN_SIZES = (1, 2, 3, 4, 5, 6, 7, 8, 12, 16, 24, 32)


@dataclass(frozen=True)
class Bucket:
    lo: int  # first cache slot of the padded range
    batch: int  # B: slots in the range
    new_tokens: int  # Tb
    num_logits: int  # Nb
    hidden: bool  # a drafter step (hidden_states input)

    @property
    def hi(self) -> int:
        return self.lo + self.batch


def round_up(n: int, sizes: tuple[int, ...]) -> int | None:
    """The smallest size >= n, or None when n is beyond the ladder."""
    assert n >= 1, n
    return next((s for s in sizes if s >= n), None)


def plan_bucket(lo: int, hi: int, new_tokens: int, num_logits: int, slots: int,
                hidden: bool) -> Bucket | None:
    """The padded bucket of a step over slots [lo, hi) of a `slots`-slot cache, or None when
    the step is too large for a graph (a long prefill)."""
    assert 0 <= lo < hi <= slots, (lo, hi, slots)
    t, n = round_up(new_tokens, TOKEN_SIZES), round_up(num_logits, TOKEN_SIZES)
    if t is None or n is None:
        return None
    batch = min(round_up(hi - lo, BATCH_SIZES) or slots, slots)
    b_lo = min(lo, slots - batch)  # shift down so the range stays inside the cache
    assert b_lo <= lo and hi <= b_lo + batch, (lo, hi, b_lo, batch)
    return Bucket(b_lo, batch, t, n, hidden)


def exact_bucket(lo: int, hi: int, new_tokens: int, num_logits: int, hidden: bool) -> Bucket:
    """No padding: what an eager run takes."""
    return Bucket(lo, hi - lo, new_tokens, num_logits, hidden)


def pad_feeds(feeds: dict[str, np.ndarray], lengths: np.ndarray, lo: int,
              bucket: Bucket) -> dict[str, np.ndarray]:
    """Step feeds over slots [lo, lo + batch) (build_step_inputs) -> feeds of `bucket`'s shapes.

    lengths: [slots] the cache's valid rows per slot, before this step (idle rows keep
    seqlens_k = length - 1, as build_step_inputs gives them)."""
    batch, new_tokens = feeds["input_ids"].shape
    num_logits = feeds["logits_index"].shape[1]
    B, T, N = bucket.batch, bucket.new_tokens, bucket.num_logits
    assert bucket.lo <= lo and lo + batch <= bucket.hi, (lo, batch, bucket)
    assert new_tokens <= T and num_logits <= N, (new_tokens, num_logits, bucket)
    rows = slice(lo - bucket.lo, lo - bucket.lo + batch)
    input_ids = np.zeros((B, T), dtype=np.int64)  # (B, T)
    input_ids[rows, :new_tokens] = feeds["input_ids"]
    position_ids = np.zeros((B, T), dtype=np.int64)  # (B, T)
    position_ids[rows, :new_tokens] = feeds["position_ids"]
    # padding columns repeat the last position (any in-range position is allowed)
    position_ids[rows, new_tokens:] = feeds["position_ids"][:, -1:]
    seqlens_k = np.maximum(lengths[bucket.lo:bucket.hi] - 1, 0).astype(np.int32)  # (B,)
    seqlens_k[rows] = feeds["seqlens_k"]
    query_seqlens = np.zeros(B, dtype=np.int32)  # (B,)
    query_seqlens[rows] = feeds["query_seqlens"]
    logits_index = np.zeros((B, N), dtype=np.int64)  # (B, N)
    logits_index[rows, :num_logits] = feeds["logits_index"]
    out = {
        "input_ids": input_ids,
        "position_ids": position_ids,
        "seqlens_k": seqlens_k,
        "query_seqlens": query_seqlens,
        "total_sequence_length": np.array(int(seqlens_k.max()) + 1, dtype=np.int32),
        "logits_index": logits_index,
    }
    if "hidden_states" in feeds:
        h = feeds["hidden_states"]
        hidden = np.zeros((B, T, h.shape[-1]), dtype=h.dtype)  # (B, T, H)
        hidden[rows, :new_tokens] = h
        out["hidden_states"] = hidden
    return out
