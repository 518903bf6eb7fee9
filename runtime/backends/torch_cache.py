"""The KV cache of the device backends (torch-cuda, trt): its block a torch tensor on the device.
Here, not beside the torch-cuda backend, because the trt backend needs it too and the runtime
never imports export/."""

from __future__ import annotations

import torch

from trt_spec.runtime.config import ModelConfig
from trt_spec.runtime.kv_cache import KVCache


class TorchKVCache(KVCache):
    """KVCache with its block on a torch device: [2L, slots, kv_heads, max_len + 1, head_dim]
    (KVCache's scratch row per slot: export/torch_backend.py attention_in_place). Lengths and slots stay on the
    host."""

    def __init__(self, config: ModelConfig, slots: int, max_len: int, device: torch.device,
                 num_layers: int | None = None, dtype: torch.dtype = torch.float32):
        self.device, self.dtype = device, dtype
        super().__init__(config, slots, max_len, num_layers)

    def zeros(self, shape: tuple[int, ...]):
        return torch.zeros(shape, dtype=self.dtype, device=self.device)
