"""Preallocated KV cache: one [slots, kv_heads, max_len, head_dim] buffer per layer and kind.

A stream owns a slot; its length is how many cache rows are valid. Nothing is ever copied:
a backend binds a view of the buffers as both the past and the present of its graph, and
rejecting tokens only lowers a length (`rewind`).
"""

from __future__ import annotations

import numpy as np

from trt_spec.runtime.config import ModelConfig


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

    @property
    def slots(self) -> int:
        return len(self.lengths)

    @property
    def free_slots(self) -> int:
        return len(self._free)

    @property
    def nbytes(self) -> int:
        return self._block.nbytes

    def allocate(self) -> int:
        if not self._free:
            raise RuntimeError(f"all {self.slots} KV-cache slots are in use")
        slot = self._free.pop()
        self.lengths[slot] = 0
        return slot

    def release(self, slot: int) -> None:
        assert slot not in self._free, slot
        self.lengths[slot] = 0
        self._free.append(slot)

    def rewind(self, slot: int, length: int) -> None:
        """Discards rows >= length (no copy: they are overwritten by the next step)."""
        assert 0 <= length <= self.lengths[slot], (length, self.lengths[slot])
        self.lengths[slot] = length

    def views(self, lo: int, hi: int) -> list[np.ndarray]:
        """Contiguous, zero-copy views of slots [lo, hi) for every layer."""
        return [b[lo:hi] for b in self.buffers]
