"""Python implementations of the TensorRT-lowered graphs' non-standard ops, for
`onnx.reference.ReferenceEvaluator`, so a TRT-lowered graph runs (slowly) on any CPU.

Each follows NVIDIA's documented semantics (sources in plugins/attention.py's docstring):
- `trt::TRT_KVCacheUpdate` (mode "linear", update_form "padded_bhnd", axis -2):
  Y = past_cache; Y[b, :, write_indices[b] + s, :] = update[b, :, s, :]; writes past max_len
  are dropped.
- `trt::TRT_Attention` (padded_bhnd forms, softmax): Y = softmax(Q K^T + mask) V with no
  implicit scale, GQA by repeating each K/V head N_q / N_kv times, keys j >= kv_lengths[b]
  hidden, causal_kind "lower_right" (query s of S_q sees j <= kv_len - S_q + s), "upper_left"
  (j <= s) or "none"; a bool attn_mask keeps True positions, another is added. A query row
  that sees no key gives 0.
- `trt_spec::SpecVerify`: plugins/spec_verify.py's NumPy reference.

Usage: `ReferenceEvaluator(model, new_ops=REFERENCE_OPS)`.
"""

from __future__ import annotations

import numpy as np
from onnx.reference.op_run import OpRun

from trt_spec.plugins.attention import TRT_DOMAIN
from trt_spec.plugins.spec_verify import spec_verify_reference


class TRT_KVCacheUpdate(OpRun):  # noqa: N801 (the op's name)
    op_domain = TRT_DOMAIN

    def _run(self, past_cache, update, write_indices=None, update_lengths=None,
             update_form=None, mode=None, axis=None):
        assert (update_form or "padded_bhnd") == "padded_bhnd", update_form
        assert (mode or "linear") == "linear" and (axis if axis is not None else -2) == -2
        out = past_cache.copy()
        max_len = out.shape[2]
        starts = np.zeros(out.shape[0], np.int64) if write_indices is None else write_indices
        for b, start in enumerate(starts):
            rows = min(update.shape[2], max_len - int(start))  # out-of-range writes dropped
            if rows > 0:
                out[b, :, start:start + rows] = update[b, :, :rows]
        return (out,)


class TRT_Attention(OpRun):  # noqa: N801
    op_domain = TRT_DOMAIN

    def _run(self, Q, K, V, attn_mask=None, query_lengths=None, kv_lengths=None,  # noqa: N803
             query_form=None, kv_form=None, causal_kind=None, TRT_decomposable=None,  # noqa: N803
             TRT_normalization_op=None, nb_rank=None):  # noqa: N803
        assert (query_form or "padded_bhnd") == "padded_bhnd" == (kv_form or "padded_bhnd")
        assert (TRT_normalization_op or "softmax") == "softmax", TRT_normalization_op
        causal = causal_kind or "none"
        assert attn_mask is None or causal == "none", "a mask needs causal_kind 'none'"
        batch, heads, s_q, _ = Q.shape
        group = heads // K.shape[1]
        keys = np.repeat(K.astype(np.float64), group, axis=1)  # (B, h, S_kv, D)
        values = np.repeat(V.astype(np.float64), group, axis=1)
        scores = Q.astype(np.float64) @ keys.transpose(0, 1, 3, 2)  # (B, h, S_q, S_kv)
        s_kv = scores.shape[-1]
        lengths = np.full(batch, s_kv) if kv_lengths is None else kv_lengths.astype(np.int64)
        rows = np.arange(s_q)[:, None]
        cols = np.arange(s_kv)[None]
        allowed = np.zeros((batch, 1, s_q, s_kv), bool)
        for b, n in enumerate(lengths):
            ok = np.broadcast_to(cols < n, (s_q, s_kv))
            if causal == "lower_right":
                ok = ok & (cols <= n - s_q + rows)
            elif causal == "upper_left":
                ok = ok & (cols <= rows)
            allowed[b, 0] = ok
        if attn_mask is not None:
            if attn_mask.dtype == bool:
                allowed = allowed & attn_mask
            else:
                scores = scores + attn_mask
        scores = np.where(allowed, scores, -np.inf)
        top = scores.max(-1, keepdims=True)
        w = np.where(allowed, np.exp(scores - np.where(np.isfinite(top), top, 0.0)), 0.0)
        total = w.sum(-1, keepdims=True)
        w = w / np.where(total > 0, total, 1.0)
        return ((w @ values).astype(Q.dtype),)


class SpecVerify(OpRun):
    op_domain = "trt_spec"

    def _run(self, draft_tokens, draft_lens, target_logits, seed, position, temperature, top_k,
             top_p):
        accepted, tokens = spec_verify_reference(draft_tokens, draft_lens, target_logits, seed,
                                                 position, temperature, top_k, top_p)
        return accepted, tokens


REFERENCE_OPS = [TRT_KVCacheUpdate, TRT_Attention, SpecVerify]
