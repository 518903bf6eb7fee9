"""Preallocated KV cache: one [slots, kv_heads, max_len, head_dim] buffer per layer and kind.

A stream owns a slot; its length is how many cache rows are valid. Nothing is ever copied
on a step: a backend binds a view of the buffers as both the past and the present of its
graph, and rejecting tokens only lowers a length (`rewind`).

A slot may outlive its request (prefix caching, runtime/prefix_cache.py): `release(slot,
keep=...)` records the token ids its rows hold, and the slot stays free but kept until an
`allocate` takes it (by name, for a prompt that starts with those tokens, or as the least
recently kept when no empty slot is left). `copy_rows` gives a second request the same rows.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from trt_spec.runtime.config import ModelConfig


@dataclass(frozen=True)
class Kept:
    """What a free slot still holds: the ids of the tokens in its rows [0, len(tokens))."""

    tokens: np.ndarray  # [n] int64
    owner: int  # the stream that wrote them (its drafters' caches may follow it)


class KVCache:
    # rows per slot past max_len that a backend writes padding to (OrtTarget's throwaway row
    # of a 1-token step; the torch-cuda backend's padded rows)
    scratch_rows = 1

    def zeros(self, shape: tuple[int, ...]):
        """The cache block: host memory here (ORT binds views of it)."""
        return np.zeros(shape, dtype=np.float32)

    def __init__(self, config: ModelConfig, slots: int, max_len: int, num_layers: int | None = None):
        if slots < 1:
            raise ValueError(f"slots={slots}: need at least 1")
        if not 2 <= max_len <= config.max_position_embeddings:
            raise ValueError(f"max_len={max_len} is outside 2..{config.max_position_embeddings} "
                             "(the model's max_position_embeddings)")
        layers = config.num_layers if num_layers is None else num_layers
        shape = (slots, config.num_kv_heads, max_len + self.scratch_rows, config.head_dim)
        # One block for all layers; a view per (layer, key|value). Zeroed so unused rows
        # never hold NaNs that a masked-out score could still touch.
        self._block = self.zeros((2 * layers, *shape))
        self.buffers = list(self._block)  # 2L x [slots, kv_heads, max_len (+ scratch), head_dim]
        self.max_len = max_len
        self.lengths = np.zeros(slots, dtype=np.int64)  # valid rows per slot
        self._free = list(range(slots))[::-1]
        self.kept: OrderedDict[int, Kept] = OrderedDict()  # free slots that hold rows, LRU first

    def reserve(self) -> None:
        """Makes every page of the cache resident now (a server: its memory at start is what
        it will use once the prefix cache has filled every slot)."""
        self._block[...] = 0

    @property
    def slots(self) -> int:
        return len(self.lengths)

    @property
    def free_slots(self) -> int:
        return len(self._free)

    @property
    def free(self) -> list[int]:
        """The free slots (kept ones included)."""
        return list(self._free)

    @property
    def nbytes(self) -> int:
        return self._block.nbytes

    def allocate(self, slot: int | None = None) -> int:
        """A free slot, its length 0: `slot` itself (it must be free), else one that keeps no
        rows, else the least recently kept (its rows are dropped). A kept slot handed out is
        no longer kept: its caller decides which of its rows stay valid (`lengths`)."""
        if not self._free:
            raise RuntimeError(f"all {self.slots} KV-cache slots are in use")
        if slot is None:
            empty = [s for s in self._free if s not in self.kept]
            slot = empty[-1] if empty else next(iter(self.kept))
        assert slot in self._free, slot
        self._free.remove(slot)
        self.kept.pop(slot, None)
        self.lengths[slot] = 0
        return slot

    def release(self, slot: int, keep: list[int] | None = None, owner: int = -1) -> None:
        """Frees the slot. keep: the token ids its rows [0, len(keep)) hold, kept for a later
        request that starts with them (runtime/prefix_cache.py); None: nothing kept."""
        assert slot not in self._free, slot
        assert keep is None or len(keep) <= self.max_len, (len(keep), self.max_len)
        self.lengths[slot] = 0
        self._free.append(slot)
        if keep is not None and len(keep):
            self.kept[slot] = Kept(np.asarray(keep, dtype=np.int64), owner)

    def forget(self) -> None:
        """Drops every kept slot's rows (they stay free)."""
        self.kept.clear()

    def copy_rows(self, src: int, dst: int, n: int) -> None:
        """Rows [0, n) of slot src into slot dst, every layer (dst's length is the caller's)."""
        assert src != dst and 0 <= n <= self.max_len, (src, dst, n)
        for b in self.buffers:
            b[dst, :, :n] = b[src, :, :n]

    def rewind(self, slot: int, length: int) -> None:
        """Discards rows >= length (no copy: they are overwritten by the next step)."""
        assert 0 <= length <= self.lengths[slot], (length, self.lengths[slot])
        self.lengths[slot] = length

    def views(self, lo: int, hi: int) -> list[np.ndarray]:
        """Contiguous, zero-copy views of slots [lo, hi) for every layer."""
        return [b[lo:hi] for b in self.buffers]
