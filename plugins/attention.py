"""Attention with an in-place KV cache: GQA, RoPE, lower-right causal mask, optional sliding
window, optional mask.

Faces of the op:
- `attention_reference`: torch eager semantics, the reference for every backend.
- `attention_numpy`: the same in NumPy (float64).
- `attention`: what export modules call; under ONNX export it emits, per the lowering
  (plugins/lowering.py):
  - "ort": ORT's `com.microsoft::GroupQueryAttention` with one max-length cache buffer per
    layer, bound as both past and present by the runtime (IOBinding), so no step copies it;
  - "trt": `attention_trt`: TensorRT's native attention and KV-cache-update ops, in the ONNX
    form TensorRT's parser takes (below).
- plugins/reference_ops.py: Python implementations of those TensorRT ops for
  `onnx.reference.ReferenceEvaluator`, written from the documents cited below.

Semantics per batch row b (the same as ORT's GroupQueryAttention with `query_seqlens`):
    Q = query_seqlens[b]     valid new tokens in this row (rows >= Q are right padding)
    T = seqlens_k[b] + 1     tokens in the cache after this step
    P = T - Q                tokens cached before this step
    new keys/values are written to cache rows [P, T); query row s sits at cache row P + s
    and attends to cache rows [0, P + s] (lower-right causal: right for verification), or,
    with an explicit `attn_mask` [batch, new_tokens, max_len] (tree drafts), to the rows
    j < T where attn_mask[b, s, j] is True.
    With `window` W > 0 (a sliding-window layer) it attends only to the last W of those:
    rows j with P + s - W < j <= P + s, i.e. (P + s) - j < W keys back, itself included: the
    rule of transformers' sliding_window_overlay (kv_idx > q_idx - sliding_window). ORT's
    GroupQueryAttention (1.32, CPU) counts `local_window_size` the same way: it gets W (checked
    against this reference at prefill, 1-token decode and multi-token steps after a past, and
    W - 1 / W + 1 shown to differ: tests/test_families.py).
Rewinding a stream is lowering its length: rows past it are simply overwritten later.

TensorRT form. RoPE and the split into heads stay plain ONNX ops (TensorRT fuses them); then

    q, k, v (B, h, T, hd)       write = seqlens_k + 1 - query_seqlens   [B] int32 (= P)
       |      \\      \\          kv_len = write + T                       [B] int32
       |       TRT_KVCacheUpdate(past_key,   k, write) -> present_key     (in place)
       |       TRT_KVCacheUpdate(past_value, v, write) -> present_value   (in place)
    q * hd^-0.5
       \\____ TRT_Attention(q, present_key, present_value, attn_mask?, -, kv_len)
               causal_kind "lower_right" without a mask, "none" with one
    A sliding window has no TRT_Attention attribute: it becomes a mask built in the graph
    (window_mask: causal and within W, ANDed with attn_mask if any), causal_kind "none".

All T update rows are written from P (rows past a row's Q valid tokens hold padding past its
length, overwritten later like any rewound row). With kv_len = P + T and lower-right
alignment query row s attends cache rows [0, P + s]: the reference's rule for every valid s.
So P + T must not exceed max_len for any row (the runtime's buckets keep it so).

Sources (NVIDIA), read for this module:
- onnx/onnx-tensorrt `docs/TRT_custom_ops.md` ("TensorRT Custom Operator Schemas"):
  `TRT_Attention`: inputs Q, K, V (index 0-2), attn_mask (3, optional; bool: True may attend,
  else added to BMM1), query_lengths (4; packed form only), kv_lengths (5; [B] per-row lengths
  in the "padded_bhnd" form); attributes query_form / kv_form ("padded_bhnd" | "packed_nhd"),
  causal_kind ("none" | "upper_left" | "lower_right"; a mask only with "none"),
  TRT_decomposable, TRT_normalization_op ("softmax"), nb_rank. "Unlike ONNX Attention,
  TRT_Attention does not use q_num_heads, kv_num_heads, or scale": Q, K, V are used as given.
  `TRT_KVCacheUpdate`: inputs past_cache [B, H, N, D], update, write_indices ([B] int32),
  update_lengths (packed only); attributes update_form ("padded_bhnd"), mode ("linear"),
  axis (-2). (An older revision of that file gives TRT_Attention `is_causal` / `scale` and
  unsupported past_key / past_value at inputs 4-5, moving the lengths to 6-7; this module
  writes the newer revision, the one that mirrors IAttention.)
- TensorRT developer guide, "Fused Attention": Q (or K) must be multiplied by the attention
  scale before IAttention; MHA, GQA (N_q % N_kv == 0) and MQA are fused.
- TensorRT operator reference "KVCacheUpdate" (10.15+) and "IKVCacheUpdateLayer": LINEAR mode
  writes output[i, :, writeIndices[i] + s, :] = update[i, :, s, :]; the cache must be a
  network input and the output, a network output, shares its memory (in place).
- TensorRT operator reference "Attention" (11.0): causalKind LOWER_RIGHT, "diagonal anchored
  at bottom-right corner (decode-aligned semantics)".
Not confirmed: the ONNX domain of the TRT_* nodes (the schema file names none; the parser's
built-in importers dispatch on op_type). They are emitted in domain "trt" (opset 1), declared
in `TRT_DOMAIN`; if a TensorRT release wants another, only `node.domain` changes.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from trt_spec.plugins import lowering

TRT_DOMAIN = "trt"


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Non-interleaved RoPE on the first rotary_dim dims (the tables' width times 2), the
    rest passed through (partial rotary, as transformers' apply_rotary_pos_emb and ORT's
    GroupQueryAttention, which reads rotary_dim from the cos_cache width).
    x: [..., head_dim]; cos, sin: [..., rotary_dim / 2]."""
    half = cos.shape[-1]
    x1, x2 = x[..., :half], x[..., half:2 * half]
    turned = [x1 * cos - x2 * sin, x2 * cos + x1 * sin]
    if 2 * half < x.shape[-1]:  # static under tracing: a full-rotary graph has no empty slice
        turned.append(x[..., 2 * half:])
    return torch.cat(turned, dim=-1)


class Heads(NamedTuple):
    """A layer's attention heads, constants of its graph: query heads, key/value heads (GQA:
    query head h reads kv head h // (num // kv)) and its sliding window W (keys
    P + s - W < j <= P + s; 0: none)."""

    num: int
    kv: int
    window: int = 0


def heads_with_rope(qkv: torch.Tensor, position_ids: torch.Tensor, cos_cache: torch.Tensor,
                    sin_cache: torch.Tensor, heads: Heads, head_dim: int):
    """qkv [batch, new_tokens, (num_heads + 2 kv_heads) head_dim] -> q [B, nh, T, hd], k and v
    [B, kvh, T, hd], RoPE applied to q and k at position_ids [B, T]."""
    num_heads, kv_heads = heads.num, heads.kv
    batch, new_tokens, _ = qkv.shape
    q, k, v = qkv.split([num_heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    q = q.view(batch, new_tokens, num_heads, head_dim).transpose(1, 2)
    k = k.view(batch, new_tokens, kv_heads, head_dim).transpose(1, 2)
    v = v.view(batch, new_tokens, kv_heads, head_dim).transpose(1, 2)
    cos = cos_cache[position_ids].unsqueeze(1).to(q.dtype)  # (B, 1, T, rot/2)
    sin = sin_cache[position_ids].unsqueeze(1).to(q.dtype)
    return rotate(q, cos, sin), rotate(k, cos, sin), v


def attention_reference(
    qkv: torch.Tensor,  # [batch, new_tokens, (num_heads + 2 * kv_heads) * head_dim]
    past_key: torch.Tensor,  # [batch, kv_heads, max_len, head_dim]
    past_value: torch.Tensor,  # [batch, kv_heads, max_len, head_dim]
    seqlens_k: torch.Tensor,  # [batch] int32: tokens in cache after this step, minus 1
    query_seqlens: torch.Tensor,  # [batch] int32: valid new tokens per row
    position_ids: torch.Tensor,  # [batch, new_tokens] int64
    cos_cache: torch.Tensor,  # [max_positions, rotary_dim / 2]
    sin_cache: torch.Tensor,  # [max_positions, rotary_dim / 2]
    heads: Heads,
    attn_mask: torch.Tensor | None = None,  # [batch, new_tokens, max_len] bool, or None: causal
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns (output [batch, new_tokens, num_heads * head_dim], present_key, present_value)."""
    num_heads, kv_heads, window = heads
    batch, new_tokens, _ = qkv.shape
    head_dim = past_key.shape[-1]
    q, k, v = heads_with_rope(qkv, position_ids, cos_cache, sin_cache, heads, head_dim)

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
        hidden = cols > rows if attn_mask is None else ~attn_mask[b, :n_new, :total]
        if window > 0:
            hidden = hidden | (rows - cols >= window)
        scores = scores.masked_fill(hidden, float("-inf"))
        out[b, :, :n_new] = scores.softmax(dim=-1) @ values
    out = out.transpose(1, 2).reshape(batch, new_tokens, num_heads * head_dim)
    return out, present_key, present_value


def attention_numpy(qkv, past_key, past_value, seqlens_k, query_seqlens, position_ids,
                    cos_cache, sin_cache, heads: Heads, attn_mask=None):
    """NumPy (float64) twin of `attention_reference`: same arguments as arrays, same result."""
    num_heads, kv_heads, window = heads
    qkv = np.asarray(qkv, np.float64)
    batch, new_tokens, _ = qkv.shape
    head_dim = past_key.shape[-1]
    q, k, v = np.split(qkv, [num_heads * head_dim, (num_heads + kv_heads) * head_dim], axis=-1)
    q = q.reshape(batch, new_tokens, num_heads, head_dim).transpose(0, 2, 1, 3)  # (B, nh, T, hd)
    k = k.reshape(batch, new_tokens, kv_heads, head_dim).transpose(0, 2, 1, 3)
    v = v.reshape(batch, new_tokens, kv_heads, head_dim).transpose(0, 2, 1, 3)
    cos = np.asarray(cos_cache, np.float64)[position_ids][:, None]  # (B, 1, T, rot/2)
    sin = np.asarray(sin_cache, np.float64)[position_ids][:, None]

    def rope(x):  # the first 2 * half dims turn, the rest pass (partial rotary)
        half = cos.shape[-1]
        x1, x2, rest = x[..., :half], x[..., half:2 * half], x[..., 2 * half:]
        return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest], axis=-1)

    q, k = rope(q), rope(k)
    present_key = np.array(past_key, np.float64)
    present_value = np.array(past_value, np.float64)
    out = np.zeros_like(q)
    group = num_heads // kv_heads
    for b in range(batch):
        n_new, total = int(query_seqlens[b]), int(seqlens_k[b]) + 1
        past = total - n_new
        assert 0 <= past and total <= past_key.shape[2], (past, total)
        present_key[b, :, past:total] = k[b, :, :n_new]
        present_value[b, :, past:total] = v[b, :, :n_new]
        if n_new == 0:
            continue
        keys = np.repeat(present_key[b, :, :total], group, axis=0)  # (nh, total, hd)
        values = np.repeat(present_value[b, :, :total], group, axis=0)
        scores = q[b, :, :n_new] @ keys.transpose(0, 2, 1) / head_dim**0.5  # (nh, Q, total)
        if attn_mask is None:
            allowed = np.arange(total)[None] <= np.arange(n_new)[:, None] + past
        else:
            allowed = np.asarray(attn_mask[b, :n_new, :total], bool)
        if window > 0:
            allowed = allowed & (np.arange(n_new)[:, None] + past - np.arange(total)[None] < window)
        scores = np.where(allowed, scores, -np.inf)
        w = np.exp(scores - scores.max(-1, keepdims=True))
        out[b, :, :n_new] = (w / w.sum(-1, keepdims=True)) @ values
    out = out.transpose(0, 2, 1, 3).reshape(batch, new_tokens, num_heads * head_dim)
    return out, present_key, present_value


def window_mask(write: torch.Tensor, new_tokens: int, max_len, window: int) -> torch.Tensor:
    """write [B] (P, rows cached before) -> [B, new_tokens, max_len] bool: query row s may see
    cache row j when P + s - window < j <= P + s."""
    rows = write.long()[:, None] + torch.arange(new_tokens, device=write.device)[None]  # (B, T)
    cols = torch.arange(max_len, device=write.device)  # (L,)
    back = rows[:, :, None] - cols[None, None]  # (B, T, L) keys back from the query
    return (back >= 0) & (back < window)


def attention_trt(qkv, past_key, past_value, seqlens_k, query_seqlens, position_ids,
                  cos_cache, sin_cache, heads: Heads, attn_mask=None):
    """The TensorRT lowering (traced under ONNX export): shapes as `attention_reference`.
    See the module docstring for the node forms and their sources."""
    num_heads, window = heads.num, heads.window
    batch, new_tokens, _ = qkv.shape
    head_dim = past_key.shape[-1]
    q, k, v = heads_with_rope(qkv, position_ids, cos_cache, sin_cache, heads, head_dim)
    q = q * head_dim**-0.5  # TRT wants Q pre-scaled
    write = (seqlens_k + 1 - query_seqlens).to(torch.int32)  # (B,) P: rows cached before
    kv_len = write + new_tokens  # (B,) int32
    update = {"update_form": "padded_bhnd", "mode": "linear", "axis": -2}
    present_key = torch.onnx.ops.symbolic(
        f"{TRT_DOMAIN}::TRT_KVCacheUpdate", [past_key, k, write], attrs=update,
        dtype=past_key.dtype, shape=past_key.shape, version=1)
    present_value = torch.onnx.ops.symbolic(
        f"{TRT_DOMAIN}::TRT_KVCacheUpdate", [past_value, v, write], attrs=update,
        dtype=past_value.dtype, shape=past_value.shape, version=1)
    form = {"query_form": "padded_bhnd", "kv_form": "padded_bhnd", "TRT_decomposable": 1,
            "TRT_normalization_op": "softmax"}
    if window > 0:  # no window attribute: a mask, causal within the window
        sliding = window_mask(write, new_tokens, past_key.shape[2], window)
        attn_mask = sliding if attn_mask is None else attn_mask & sliding
    if attn_mask is None:
        inputs = [q, present_key, present_value, None, None, kv_len]
        form["causal_kind"] = "lower_right"
    else:
        inputs = [q, present_key, present_value, attn_mask.unsqueeze(1), None, kv_len]
        form["causal_kind"] = "none"
    out = torch.onnx.ops.symbolic(f"{TRT_DOMAIN}::TRT_Attention", inputs, attrs=form,
                                  dtype=q.dtype, shape=q.shape, version=1)  # (B, nh, T, hd)
    out = out.transpose(1, 2).reshape(batch, new_tokens, num_heads * head_dim)
    return out, present_key, present_value


def attention(qkv, past_key, past_value, seqlens_k, query_seqlens, position_ids,
              total_sequence_length, cos_cache, sin_cache, heads: Heads, attn_mask=None):
    """Shapes as `attention_reference`; total_sequence_length: [] int32, an upper bound of
    seqlens_k + 1 (ORT checks it; the reference and TensorRT do not need it). heads: the
    layer's, constants of the graph (its sliding window too)."""
    if not torch.onnx.is_in_onnx_export():
        return attention_reference(qkv, past_key, past_value, seqlens_k, query_seqlens,
                                   position_ids, cos_cache, sin_cache, heads, attn_mask)
    if lowering.current() == "trt":
        return attention_trt(qkv, past_key, past_value, seqlens_k, query_seqlens, position_ids,
                             cos_cache, sin_cache, heads, attn_mask)
    num_heads, kv_heads, window = heads
    if attn_mask is not None:
        raise NotImplementedError("an explicit attention mask lowers for TensorRT only so far")
    batch, new_tokens, _ = qkv.shape
    head_dim = past_key.shape[-1]
    return torch.onnx.ops.symbolic_multi_out(
        "com.microsoft::GroupQueryAttention",
        [qkv, None, None, past_key, past_value, seqlens_k, total_sequence_length,
         cos_cache, sin_cache, position_ids, None, None, None, None, None, None, query_seqlens],
        attrs={"num_heads": num_heads, "kv_num_heads": kv_heads, "do_rotary": 1,
               "rotary_interleaved": 0,
               # the same count as `window` (module docstring)
               **({"local_window_size": window} if window > 0 else {})},
        dtypes=[qkv.dtype, past_key.dtype, past_value.dtype],
        shapes=[[batch, new_tokens, num_heads * head_dim], past_key.shape, past_value.shape],
        version=1,
    )
