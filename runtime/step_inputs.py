"""Turn per-stream requests into the padded, fixed-rank inputs every target-style graph takes.

A step runs over a contiguous range of cache slots [lo, hi). Slots in the range that have
nothing to do this step are idle rows (query_seqlens = 0): their cache is left untouched.

Every row of a step is padded to its widest request (`columns`), and the attention kernels
place a row's padded columns after the row's cached tokens, idle rows included: so a step
fits only when every slot of its range has room for that many columns (`fits`). A stream
near the end of the context beside a long prompt chunk does not; the step is then run one
request at a time (StepGraph.step, runtime/backends/base.py), where each request fits alone.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from trt_spec.runtime.kv_cache import KVCache


@dataclass(frozen=True)
class SlotTokens:
    slot: int
    tokens: list[int]  # new tokens, appended at the slot's current length
    logits_at: list[int]  # indices into `tokens` whose logits are wanted
    hidden: np.ndarray | None = None  # [len(tokens), H]: a drafter graph's hidden_states


@dataclass
class StepInputs:
    lo: int
    hi: int
    rows: list[int]  # row of each request in the batch
    feeds: dict[str, np.ndarray]


def columns(requests: list[SlotTokens], min_rows: int = 1) -> int:
    """T: the token columns of a step over `requests` (build_step_inputs' new_tokens): its
    widest request, or more so that batch x T >= min_rows."""
    slots = [r.slot for r in requests]
    least = -(-min_rows // (max(slots) + 1 - min(slots)))
    return max(max(len(r.tokens) for r in requests), least)


def fits(cache: KVCache, requests: list[SlotTokens], min_rows: int = 1) -> bool:
    """Whether every slot of the step's range, idle ones included, has room in its cache rows
    (max_len + scratch) for the step's padded columns after its cached tokens."""
    lo, hi = min(r.slot for r in requests), max(r.slot for r in requests) + 1
    room = cache.max_len + cache.scratch_rows - cache.lengths[lo:hi]
    return bool((room >= columns(requests, min_rows)).all())


def build_step_inputs(cache: KVCache, requests: list[SlotTokens], max_positions: int,
                      scratch: int = 0, min_rows: int = 1) -> StepInputs:
    """scratch: rows a request may write past the cache's max_len (at most cache.scratch_rows;
    a throwaway row that no later step reads). min_rows: the step runs at least this many
    token rows and logits rows in all (B x T, B x N), padding columns where it has fewer:
    kernels that round a 1-row product differently from a product of several (exact
    decoding, runtime/backends/exact_rows.py) then always see several."""
    if not requests:
        raise ValueError("a step needs at least one request")
    slots = [r.slot for r in requests]
    if len(set(slots)) != len(slots):
        raise ValueError(f"a slot appears twice in one step: {slots}")
    lo, hi = min(slots), max(slots) + 1
    batch = hi - lo
    least = -(-min_rows // batch)  # columns so that batch x columns >= min_rows
    new_tokens = columns(requests, min_rows)
    num_logits = max(max(len(r.logits_at) for r in requests), 1, least)
    input_ids = np.zeros((batch, new_tokens), dtype=np.int64)  # (B, T)
    position_ids = np.zeros((batch, new_tokens), dtype=np.int64)  # (B, T)
    lengths = cache.lengths[lo:hi]
    seqlens_k = np.maximum(lengths - 1, 0).astype(np.int32)  # (B,) idle rows: unchanged
    query_seqlens = np.zeros(batch, dtype=np.int32)  # (B,)
    logits_index = np.zeros((batch, num_logits), dtype=np.int64)  # (B, N)
    with_hidden = [r.hidden is not None for r in requests]
    if any(with_hidden) and not all(with_hidden):
        raise ValueError("either every request of a step carries hidden states or none does")
    hidden = (np.zeros((batch, new_tokens, requests[0].hidden.shape[-1]), dtype=np.float32)
              if all(with_hidden) else None)  # (B, T, H)
    for r in requests:
        row, n, past = r.slot - lo, len(r.tokens), int(cache.lengths[r.slot])
        if n == 0:
            raise ValueError(f"slot {r.slot}: a request needs at least one token")
        if past + n > cache.max_len + min(scratch, cache.scratch_rows):
            raise ValueError(f"slot {r.slot}: {past} cached + {n} new tokens exceed the cache "
                             f"length {cache.max_len}")
        if past + n > max_positions:
            raise ValueError(f"slot {r.slot}: position {past + n - 1} is beyond the model's "
                             f"{max_positions} positions")
        if any(not 0 <= i < n for i in r.logits_at):
            raise ValueError(f"slot {r.slot}: logits_at {r.logits_at} outside 0..{n - 1}")
        input_ids[row, :n] = r.tokens
        if hidden is not None:
            if r.hidden.shape != (n, hidden.shape[-1]):
                raise ValueError(f"slot {r.slot}: hidden {r.hidden.shape} for {n} tokens")
            hidden[row, :n] = r.hidden
        position_ids[row, :n] = np.arange(past, past + n)
        position_ids[row, n:] = past + n - 1  # padding: any in-range position
        seqlens_k[row] = past + n - 1
        query_seqlens[row] = n
        logits_index[row, :len(r.logits_at)] = r.logits_at
    total = np.array(int(seqlens_k.max()) + 1, dtype=np.int32)
    feeds = {
        "input_ids": input_ids,
        "position_ids": position_ids,
        "seqlens_k": seqlens_k,
        "query_seqlens": query_seqlens,
        "total_sequence_length": total,
        "logits_index": logits_index,
    }
    if hidden is not None:
        feeds["hidden_states"] = hidden
    return StepInputs(lo, hi, [r.slot - lo for r in requests], feeds)


def commit_lengths(cache: KVCache, requests: list[SlotTokens]) -> None:
    for r in requests:
        cache.lengths[r.slot] += len(r.tokens)
