"""Full-sequence forwards for training: the target's (or a vanilla draft's) decoder over whole,
right-padded sequences with a causal mask, no KV cache.

`causal_forward` computes what TargetModel.forward computes for a prefill into an empty cache
(tests/test_train_draft.py checks it), batched, with torch's fused attention, so feature
extraction and draft training need not loop over sequences.
"""

from __future__ import annotations

import torch
from torch.nn import functional as F

from trt_spec.export.model import TargetModel
from trt_spec.plugins.attention import rotate
from trt_spec.plugins.rms_norm import rms_norm


def causal_forward(model: TargetModel, input_ids: torch.Tensor,
                   want_features: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """input_ids [B, T] -> (final-normed hidden [B, T, H], eagle3 features [B, T, 3H] (the
    inputs to config.eagle3_layers) or None). Rows past a sequence's end are padding; they
    never reach a real row (the mask is causal)."""
    c = model.config
    b, t = input_ids.shape
    positions = torch.arange(t, device=input_ids.device)
    cos = model.cos_cache[positions][None, None]  # (1, 1, T, hd/2)
    sin = model.sin_cache[positions][None, None]
    group = c.num_heads // c.num_kv_heads
    h = model.embed_tokens(input_ids)
    features = {}
    for i, layer in enumerate(model.layers):
        if want_features:
            features[i] = h
        x = rms_norm(h, layer.input_layernorm, c.rms_norm_eps)
        q, k, v = layer.qkv_proj(x).split(
            [c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.num_kv_heads * c.head_dim],
            -1)
        q = rotate(q.view(b, t, c.num_heads, c.head_dim).transpose(1, 2), cos, sin)
        k = rotate(k.view(b, t, c.num_kv_heads, c.head_dim).transpose(1, 2), cos, sin)
        v = v.view(b, t, c.num_kv_heads, c.head_dim).transpose(1, 2)
        a = F.scaled_dot_product_attention(q, k.repeat_interleave(group, 1),
                                           v.repeat_interleave(group, 1), is_causal=True)
        h = h + layer.o_proj(a.transpose(1, 2).reshape(b, t, c.num_heads * c.head_dim))
        h = h + layer.mlp(rms_norm(h, layer.post_attention_layernorm, c.rms_norm_eps))
    hidden = rms_norm(h, model.norm, c.rms_norm_eps)
    eagle3 = (torch.cat([features[i] for i in c.eagle3_layers], -1)
              if want_features and c.eagle3_layers else None)
    return hidden, eagle3
