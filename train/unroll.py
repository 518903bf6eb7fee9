"""The training forward every one-layer drafter shares, and its distillation loss.

`unroll` runs a drafter module (export/drafters.py's MTPModule or Eagle3Step, same weights)
over whole sequences for every anchor at once, with a training-time-test unroll of `steps`:

    step j, anchor a    position a + j
                        token    x_{a+o+j+1}   (o = token_offset: MTP module i reads o = i)
                        hidden   `first` at a if j = 0, else step j-1's next hidden at a
                        attends  step 0's rows 0 .. a (causal) and steps 1 .. j at anchor a
                        predicts x_{a+o+j+2}

Those are the rows the exported module's one-layer cache holds at draft step j of a propose
anchored at a (committed rows 0 .. a, then loop rows a+1 .. a+j), so the exported forward
gives the same numbers (tests/test_train_eagle3.py, tests/test_train_mtp.py check it).
"""

from __future__ import annotations

import torch

from trt_spec.export.drafters import OneLayerDrafter
from trt_spec.plugins.attention import rotate
from trt_spec.plugins.rms_norm import rms_norm
from trt_spec.train.loop import Batch


def shift(x: torch.Tensor, n: int) -> torch.Tensor:
    """x[:, p] <- x[:, p + n] along dim 1, zero-filled at the end. x: [B, T, ...]."""
    if n == 0:
        return x
    return torch.cat([x[:, n:], torch.zeros_like(x[:, :n])], 1)


def qkv_rows(module: OneLayerDrafter, tokens: torch.Tensor, hidden: torch.Tensor,
             positions: torch.Tensor):
    """tokens [B, T], hidden [B, T, H], positions [B, T] -> q [B, nh, T, hd], k and v
    [B, nh, T, hd] (kv heads repeated), RoPE applied; and the residual [B, T, H]."""
    c = module.config
    b, t = tokens.shape
    x, residual = module.layer_input(tokens, hidden)
    q, k, v = module.layer.qkv_proj(x).split(
        [c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.num_kv_heads * c.head_dim], -1)
    cos = module.cos_cache[positions].unsqueeze(1)  # (B, 1, T, rot/2)
    sin = module.sin_cache[positions].unsqueeze(1)
    group = c.num_heads // c.num_kv_heads
    q = rotate(q.view(b, t, c.num_heads, c.head_dim).transpose(1, 2), cos, sin)
    k = rotate(k.view(b, t, c.num_kv_heads, c.head_dim).transpose(1, 2), cos, sin)
    v = v.view(b, t, c.num_kv_heads, c.head_dim).transpose(1, 2)
    return q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1), residual


def unroll(module: OneLayerDrafter, input_ids: torch.Tensor, first: torch.Tensor, steps: int,
           token_offset: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """input_ids [B, T]; first [B, T, H] (the hidden input of step 0) -> per step j
    (logits [B, T, head_vocab], next hidden [B, T, H]) for every anchor (see the module
    docstring; rows whose token lies past the sequence are padding)."""
    c = module.config
    b, t = input_ids.shape
    anchors = torch.arange(t, device=input_ids.device).expand(b, t)
    causal = torch.ones(t, t, dtype=torch.bool, device=input_ids.device).tril()  # key <= anchor
    scale = c.head_dim ** -0.5
    hidden = first
    k0 = v0 = None  # step 0's keys / values [B, nh, T, hd]: read causally
    diag_k, diag_v = [], []  # steps 1..j, [B, nh, T, hd] each: read at their own anchor only
    out = []
    for j in range(steps):
        q, k, v, residual = qkv_rows(module, shift(input_ids, token_offset + j + 1), hidden,
                                     anchors + j)
        if j == 0:
            k0, v0 = k, v
        else:
            diag_k.append(k)
            diag_v.append(v)
        scores = ((q @ k0.transpose(-1, -2)) * scale).masked_fill(~causal, float("-inf"))
        extra = [(q * kd).sum(-1, keepdim=True) * scale for kd in diag_k]  # (B, nh, T, 1) each
        weights = torch.cat([scores, *extra], -1).softmax(-1)  # (B, nh, T, T + j)
        a = weights[..., :t] @ v0
        for i, vd in enumerate(diag_v):
            a = a + weights[..., t + i:t + i + 1] * vd
        a = a.transpose(1, 2).reshape(b, t, c.num_heads * c.head_dim)
        h = residual + module.layer.o_proj(a)
        h = h + module.layer.mlp(rms_norm(h, module.layer.post_attention_layernorm,
                                          c.rms_norm_eps))
        out.append((module.head(rms_norm(h, module.head_norm, c.rms_norm_eps)), h))
        hidden = h
    return out


def soft_labels(topk_ids: torch.Tensor, topk_probs: torch.Tensor, t2d_index: torch.Tensor):
    """topk_ids, topk_probs [B, T, k] (target ids) -> (head ids [B, T, k] (0 where outside),
    probs [B, T, k] renormalised over the head's vocabulary, has_mass [B, T] bool).
    t2d_index [vocab]: the head id of each target id, -1 outside its vocabulary."""
    ids = t2d_index[topk_ids]
    p = topk_probs * (ids >= 0)
    mass = p.sum(-1, keepdim=True)
    return ids.clamp(min=0), p / mass.clamp(min=1e-12), mass[..., 0] > 0


def top1_hits(logits: torch.Tensor, batch: Batch, ahead: int,
              head_to_target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [B, T, head_vocab] at anchor rows predicting x_{a+ahead+2} -> (hit [B, T] bool:
    the head's argmax, as a target id, is the target's argmax at position a+ahead+1; valid
    [B, T] bool: the predicted token exists and is an assistant token)."""
    t = batch.input_ids.shape[1]
    rows = torch.arange(t, device=logits.device)
    valid = (rows + ahead + 2 < batch.lengths[:, None]) & shift(batch.loss_mask, ahead + 2)
    hit = head_to_target[logits.argmax(-1)] == shift(batch.topk_ids, ahead + 1)[..., 0]
    return hit, valid


def distill_loss(logits: torch.Tensor, batch: Batch, ahead: int, t2d_index: torch.Tensor,
                 head_to_target: torch.Tensor) -> tuple[torch.Tensor, float]:
    """logits [B, T, head_vocab] at anchor rows predicting x_{a+ahead+2} -> (soft cross
    entropy against the target's top-k at position a+ahead+1, averaged over anchors whose
    predicted token exists and is an assistant token; accuracy: top1_hits over those
    anchors). head_to_target [head_vocab]: target id of each."""
    ids, probs, has_mass = soft_labels(shift(batch.topk_ids, ahead + 1),
                                       shift(batch.topk_probs, ahead + 1), t2d_index)
    hit, valid = top1_hits(logits, batch, ahead, head_to_target)
    weight = (valid & has_mass).float()  # (B, T)
    ce = -(probs * logits.float().log_softmax(-1).gather(-1, ids)).sum(-1)  # (B, T)
    loss = (ce * weight).sum() / weight.sum().clamp(min=1)
    acc = float((hit.float() * valid).sum() / valid.float().sum().clamp(min=1))
    return loss, acc
