"""Attention with an in-place KV cache: GQA, RoPE, lower-right causal mask.

Faces of the op:
- `attention_reference`: torch eager semantics, the reference for every backend.
- `attention`: what export modules call; under ONNX export it emits ORT's
  `com.microsoft::GroupQueryAttention` with one max-length cache buffer per layer,
  bound as both past and present by the runtime (IOBinding), so no step copies it.

Semantics per batch row b (the same as ORT's GroupQueryAttention with `query_seqlens`):
    Q = query_seqlens[b]     valid new tokens in this row (rows >= Q are right padding)
    T = seqlens_k[b] + 1     tokens in the cache after this step
    P = T - Q                tokens cached before this step
    new keys/values are written to cache rows [P, T); query row s sits at cache row P + s
    and attends to cache rows [0, P + s] (lower-right causal: right for verification).
Rewinding a stream is lowering its length: rows past it are simply overwritten later.
"""

from __future__ import annotations

import torch


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Non-interleaved RoPE. x: [..., head_dim]; cos, sin: [..., head_dim / 2]."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def attention_reference(
    qkv: torch.Tensor,  # [batch, new_tokens, (num_heads + 2 * kv_heads) * head_dim]
    past_key: torch.Tensor,  # [batch, kv_heads, max_len, head_dim]
    past_value: torch.Tensor,  # [batch, kv_heads, max_len, head_dim]
    seqlens_k: torch.Tensor,  # [batch] int32: tokens in cache after this step, minus 1
    query_seqlens: torch.Tensor,  # [batch] int32: valid new tokens per row
    position_ids: torch.Tensor,  # [batch, new_tokens] int64
    cos_cache: torch.Tensor,  # [max_positions, head_dim / 2]
    sin_cache: torch.Tensor,  # [max_positions, head_dim / 2]
    num_heads: int,
    kv_heads: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns (output [batch, new_tokens, num_heads * head_dim], present_key, present_value)."""
    batch, new_tokens, _ = qkv.shape
    head_dim = past_key.shape[-1]
    q, k, v = qkv.split([num_heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    q = q.view(batch, new_tokens, num_heads, head_dim).transpose(1, 2)  # (B, nh, T, hd)
    k = k.view(batch, new_tokens, kv_heads, head_dim).transpose(1, 2)  # (B, kvh, T, hd)
    v = v.view(batch, new_tokens, kv_heads, head_dim).transpose(1, 2)
    cos = cos_cache[position_ids].unsqueeze(1)  # (B, 1, T, hd/2)
    sin = sin_cache[position_ids].unsqueeze(1)
    q, k = rotate(q, cos, sin), rotate(k, cos, sin)

    present_key, present_value = past_key.clone(), past_value.clone()
    out = torch.zeros_like(q)
    group = num_heads // kv_heads
    for b in range(batch):
        n_new = int(query_seqlens[b])
        total = int(seqlens_k[b]) + 1
        past = total - n_new
        assert 0 <= past and total <= past_key.shape[2], (past, total)
        present_key[b, :, past:total] = k[b, :, :n_new]
        present_value[b, :, past:total] = v[b, :, :n_new]
        if n_new == 0:
            continue
        keys = present_key[b, :, :total].repeat_interleave(group, dim=0)  # (nh, total, hd)
        values = present_value[b, :, :total].repeat_interleave(group, dim=0)
        scores = q[b, :, :n_new] @ keys.transpose(-1, -2) / head_dim**0.5  # (nh, Q, total)
        rows = torch.arange(n_new).unsqueeze(1) + past
        cols = torch.arange(total).unsqueeze(0)
        scores = scores.masked_fill(cols > rows, float("-inf"))
        out[b, :, :n_new] = scores.softmax(dim=-1) @ values
    out = out.transpose(1, 2).reshape(batch, new_tokens, num_heads * head_dim)
    return out, present_key, present_value


def attention(qkv, past_key, past_value, seqlens_k, query_seqlens, position_ids,
              total_sequence_length, cos_cache, sin_cache, num_heads: int, kv_heads: int):
    """Shapes as `attention_reference`; total_sequence_length: [] int32, an upper bound of
    seqlens_k + 1 (ORT checks it; the reference does not need it)."""
    if not torch.onnx.is_in_onnx_export():
        return attention_reference(qkv, past_key, past_value, seqlens_k, query_seqlens,
                                   position_ids, cos_cache, sin_cache, num_heads, kv_heads)
    batch, new_tokens, _ = qkv.shape
    head_dim = past_key.shape[-1]
    return torch.onnx.ops.symbolic_multi_out(
        "com.microsoft::GroupQueryAttention",
        [qkv, None, None, past_key, past_value, seqlens_k, total_sequence_length,
         cos_cache, sin_cache, position_ids, None, None, None, None, None, None, query_seqlens],
        attrs={"num_heads": num_heads, "kv_num_heads": kv_heads, "do_rotary": 1,
               "rotary_interleaved": 0},
        dtypes=[qkv.dtype, past_key.dtype, past_value.dtype],
        shapes=[[batch, new_tokens, num_heads * head_dim], past_key.shape, past_value.shape],
        version=1,
    )
