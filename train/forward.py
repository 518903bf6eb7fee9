"""Full-sequence forwards for training: the target's (or a vanilla draft's) decoder over whole,
right-padded sequences with a causal mask, no KV cache.

`causal_forward` computes what TargetModel.forward computes for a prefill into an empty cache
(tests/test_train_draft.py checks it), batched, with torch's fused attention, so feature
extraction and draft training need not loop over sequences.
"""

from __future__ import annotations

import torch
from torch.nn import functional as F

from trt_spec.export.model import TargetModel, layer_rope
from trt_spec.plugins.attention import rotate
from trt_spec.plugins.rms_norm import rms_norm


def heads(layer, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """x [B, T, H] (normed) -> q [B, nh, T, hd], k and v [B, kvh, T, hd], RoPE (cos, sin
    broadcast against [B, heads, T, rotary_dim / 2]) applied to q and k."""
    c = layer.config
    b, t, _ = x.shape
    q, k, v = layer.qkv(x).split(
        [c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.num_kv_heads * c.head_dim], -1)
    q = rotate(q.view(b, t, c.num_heads, c.head_dim).transpose(1, 2), cos, sin)
    k = rotate(k.view(b, t, c.num_kv_heads, c.head_dim).transpose(1, 2), cos, sin)
    return q, k, v.view(b, t, c.num_kv_heads, c.head_dim).transpose(1, 2)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     positions: torch.Tensor, window: int, group: int) -> torch.Tensor:
    """Attention of the T rows at `positions` [T] over themselves: causal, and within
    `window` when it is not 0 (0 <= i - j < window). k, v: [B, kvh, T, hd], each kv head
    serving `group` q heads -> [B, nh, T, hd]."""
    if window:
        back = positions[:, None] - positions[None, :]  # (T, T)
        mask = {"attn_mask": (back >= 0) & (back < window)}
    else:
        mask = {"is_causal": True}
    return F.scaled_dot_product_attention(q, k.repeat_interleave(group, 1),
                                          v.repeat_interleave(group, 1), **mask)


def causal_forward(model: TargetModel, input_ids: torch.Tensor,
                   want_features: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """input_ids [B, T] -> (final-normed hidden [B, T, H], eagle3 features [B, T, 3H] (the
    inputs to config.eagle3_layers) or None). Rows past a sequence's end are padding; they
    never reach a real row (the mask is causal). Every family option of the decoder applies
    (the layers' own qkv / residual steps, each layer's RoPE base and sliding window)."""
    c = model.config
    b, t = input_ids.shape
    positions = torch.arange(t, device=input_ids.device)
    group = c.num_heads // c.num_kv_heads
    h = model.embed_tokens(input_ids)
    if c.embed_scale != 1.0:
        h = h * c.embed_scale
    x = rms_norm(h, model.layers[0].input_layernorm, c.rms_norm_eps)
    features = {}
    for i, layer in enumerate(model.layers):
        if want_features:
            features[i] = h
        cos, sin = layer_rope(model, c, i)
        cos, sin = cos[positions][None, None], sin[positions][None, None]  # (1, 1, T, rot/2)
        q, k, v = heads(layer, x, cos, sin)
        a = causal_attention(q, k, v, positions, layer.window, group)
        next_norm = model.layers[i + 1].input_layernorm if i + 1 < c.num_layers else model.norm
        x, h = layer.residual(a.transpose(1, 2).reshape(b, t, c.num_heads * c.head_dim), h,
                              next_norm)
    eagle3 = (torch.cat([features[i] for i in c.eagle3_layers], -1)
              if want_features and c.eagle3_layers else None)
    return x, eagle3
