"""SpecVerify: the speculative verifier as one op, so a score graph returns tokens, not logits.

Same semantics and vocabulary as runtime/verify.py (accepted, recovered, bonus; p = target,
q = draft; Leviathan et al. 2023, Algorithm 1), written as a pure function: the random
numbers are an input. Per row b with n = draft_lens[b] valid drafts x_0..x_{n-1}:

    greedy (temperature[b] below GREEDY_TEMPERATURE, 1e-5, as runtime/sampling.py: taken as
        0 on entry, so every form agrees): accept the longest prefix with x_i == argmax(logits[b, i]);
        the next token is argmax(logits[b, a]).
    stochastic: p_i = softmax(filter(logits[b, i] / T)) (top-k, then top-p, exactly as
        runtime.sampling.probs_from_logits); accept x_i while uniforms[b, i] < p_i(x_i) / q_i(x_i);
        at the first rejection i = a the recovered token is drawn from norm(max(0, p_a - q_a))
        (p_a when that has no mass); after n acceptances the bonus token is drawn from p_n.
        The draw uses uniforms[b, min(a + 1, n)] by inverse CDF, as sample_from_probs.

The uniforms are consumed in the order the sampler draws from its generator (one per tested
draft, then one for the emitted token), so `uniforms = rng.random(k + 1)` reproduces
`stochastic_verify(..., rng)` token for token.

    inputs                                          outputs
    draft_tokens  [batch, k] int64                  num_accepted [batch] int64
    draft_lens    [batch] int32 (0..k valid drafts) tokens       [batch, k + 1] int64
    target_logits [batch, k + 1, vocab] float           row b: accepted drafts, then the
    draft_probs   [batch, k, vocab] float (full q)          recovered / bonus token, then
                  or [batch, k, 1]: a deterministic         PLACEHOLDER (-1)
                  drafter, q = one-hot of its draft
    uniforms      [batch, k + 1] float in [0, 1)
    temperature   [batch] float (0, or below 1e-5: greedy row)
    top_k         [batch] int32 (0: off)
    top_p         [batch] float (1: off)

Faces:
- `spec_verify_reference`: NumPy, per row, float64 (the definition).
- `spec_verify_torch`: pure torch, batched, any device; traceable, so tracing it is the
  op's ONNX Runtime lowering (standard ONNX ops: ArgMax, Softmax, TopK, GatherElements,
  CumSum, ScatterElements, ...). p is runtime/sampling_torch.py's probs_from_logits.
- `spec_verify`: what export modules call: under ONNX export with the "trt" lowering it emits
  one `trt_spec::SpecVerify` node (the TensorRT plugin below), else it is `spec_verify_torch`.
- `spec_verify_triton`: the Triton kernel (one program per row), shared by the TensorRT
  plugin and the torch-CUDA backend; top-k / top-p are applied as a logit mask in torch first.
- `register_trt_plugin()`: the `tensorrt.plugin` (Quickly Deployable Plugin) registration of
  `trt_spec::SpecVerify`, whose `impl` runs `spec_verify_triton` on TensorRT's stream. The
  ONNX parser maps a node with op_type "SpecVerify" and domain "trt_spec" (the plugin's
  namespace) to it (TensorRT docs, "Adding Custom Layers Using the Python API" / "Quickly
  Deployable Plugins"; onnx-tensorrt: QDP nodes parsed since 10.6).
"""

from __future__ import annotations

import numpy as np
import torch

from trt_spec.plugins import lowering
from trt_spec.runtime import sampling_torch
from trt_spec.runtime.verify import PLACEHOLDER, Q_FLOOR
from trt_spec.runtime.sampling import GREEDY_TEMPERATURE, probs_from_logits

PLUGIN = "trt_spec::SpecVerify"
RESIDUAL_FLOOR = 1e-12  # a residual with less mass than this falls back to p (as sampler.residual)


# ---------------------------------------------------------------------------------------------
# NumPy reference
# ---------------------------------------------------------------------------------------------

def inverse_cdf(weights: np.ndarray, u: float) -> int:
    """weights: [vocab] (not necessarily normalised) -> the token whose CDF interval holds u."""
    cdf = np.cumsum(weights)
    return int(min(np.searchsorted(cdf, u * cdf[-1], side="right"), len(weights) - 1))


def spec_verify_reference(draft_tokens, draft_lens, target_logits, draft_probs, uniforms,
                          temperature, top_k=None, top_p=None) -> tuple[np.ndarray, np.ndarray]:
    """Shapes as the module docstring. Returns (num_accepted [batch], tokens [batch, k + 1])."""
    draft_tokens = np.asarray(draft_tokens, dtype=np.int64)
    batch, k = draft_tokens.shape
    assert target_logits.shape[:2] == (batch, k + 1), (target_logits.shape, draft_tokens.shape)
    top_k = np.zeros(batch, np.int64) if top_k is None else np.asarray(top_k)
    top_p = np.ones(batch) if top_p is None else np.asarray(top_p)
    one_hot_q = draft_probs.shape[-1] == 1
    accepted = np.zeros(batch, np.int64)
    tokens = np.full((batch, k + 1), PLACEHOLDER, np.int64)
    for b in range(batch):
        n = int(draft_lens[b])
        assert 0 <= n <= k, (n, k)
        x = draft_tokens[b, :n]
        logits = np.asarray(target_logits[b, :n + 1], dtype=np.float64)
        if temperature[b] < GREEDY_TEMPERATURE:
            target = logits.argmax(-1)
            mismatch = np.nonzero(x != target[:n])[0]
            a = int(mismatch[0]) if mismatch.size else n
            token = int(target[a])
        else:
            p = probs_from_logits(logits, float(temperature[b]), int(top_k[b]), float(top_p[b]))
            a = n
            for i in range(n):
                q_x = 1.0 if one_hot_q else max(float(draft_probs[b, i, x[i]]), Q_FLOOR)
                if not uniforms[b, i] < p[i, x[i]] / q_x:
                    a = i
                    break
            if a < n:  # recovered token from norm(max(0, p - q))
                q = np.eye(p.shape[-1])[x[a]] if one_hot_q else draft_probs[b, a]
                r = np.maximum(p[a] - q, 0.0)
                weights = r if r.sum() > RESIDUAL_FLOOR else p[a]
            else:  # bonus token from p
                weights = p[n]
            token = inverse_cdf(weights, float(uniforms[b, min(a + 1, n)]))
        accepted[b] = a
        tokens[b, :a] = x[:a]
        tokens[b, a] = token
    return accepted, tokens


# ---------------------------------------------------------------------------------------------
# torch (any device; its trace is the ONNX Runtime lowering)
# ---------------------------------------------------------------------------------------------

def spec_verify_torch(
    draft_tokens: torch.Tensor,  # [batch, k] int64
    draft_lens: torch.Tensor,  # [batch] int32
    target_logits: torch.Tensor,  # [batch, k + 1, vocab]
    draft_probs: torch.Tensor,  # [batch, k, vocab] or [batch, k, 1] (one-hot q)
    uniforms: torch.Tensor,  # [batch, k + 1]
    temperature: torch.Tensor,  # [batch]
    top_k: torch.Tensor | None = None,  # [batch] int32
    top_p: torch.Tensor | None = None,  # [batch]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Batched SpecVerify: (num_accepted [batch] int64, tokens [batch, k + 1] int64). Computes
    in the logits' dtype promoted to at least float32."""
    batch, k = draft_tokens.shape
    vocab = target_logits.shape[-1]
    dtype = torch.promote_types(target_logits.dtype, torch.float32)
    x = draft_tokens.to(torch.int64)
    n = draft_lens.to(torch.int64).view(-1, 1)  # (B, 1)
    temperature = sampling_torch.greedy_as_zero(temperature)
    greedy = (temperature == 0).view(-1, 1)  # (B, 1)
    valid = torch.arange(k, device=x.device).view(1, -1) < n  # (B, K)

    argmax = target_logits.argmax(-1)  # (B, K+1)
    t = sampling_torch.temperature_or_one(temperature, temperature == 0)
    p = sampling_torch.probs_from_logits(target_logits, t, top_k, top_p)  # (B, K+1, V)
    if draft_probs.shape[-1] == 1:  # static: a deterministic drafter, q one-hot at its draft
        q = torch.nn.functional.one_hot(x, vocab).to(dtype)
    else:
        q = draft_probs.to(dtype)
    p_x = torch.gather(p[:, :k], -1, x.unsqueeze(-1)).squeeze(-1)  # (B, K)
    q_x = torch.gather(q, -1, x.unsqueeze(-1)).squeeze(-1).clamp_min(Q_FLOOR)
    u = uniforms.to(dtype)
    # (no bool Where: ONNX Runtime's CPU Where has no bool kernel)
    ok = ((greedy & (x == argmax[:, :k])) | (~greedy & (u[:, :k] < p_x / q_x))) & valid
    # accepted prefix length: positions before the first miss
    a = (torch.cumsum((~ok).to(torch.int64), dim=1) == 0).to(torch.int64).sum(1, keepdim=True)

    # recovered (a < n) or bonus (a == n) token, from row a
    p_a = torch.gather(p, 1, a.unsqueeze(-1).expand(batch, 1, vocab)).squeeze(1)  # (B, V)
    q_pad = torch.cat([q, torch.zeros_like(q[:, :1])], dim=1)  # (B, K+1, V): bonus row q = 0
    q_a = torch.gather(q_pad, 1, a.unsqueeze(-1).expand(batch, 1, vocab)).squeeze(1)
    q_a = torch.where(a < n, q_a, torch.zeros_like(q_a))
    r = (p_a - q_a).clamp_min(0.0)
    r = torch.where(r.sum(-1, keepdim=True) > RESIDUAL_FLOOR, r, p_a)
    cdf = torch.cumsum(r, dim=-1)
    u_a = torch.gather(u, 1, torch.minimum(a + 1, n))  # (B, 1)
    sampled = (cdf <= u_a * cdf[:, -1:]).to(torch.int64).sum(-1, keepdim=True).clamp_max(vocab - 1)
    token = torch.where(greedy, torch.gather(argmax, 1, a), sampled)  # (B, 1)

    j = torch.arange(k + 1, device=x.device).view(1, -1)
    x_pad = torch.cat([x, torch.zeros_like(x[:, :1])], dim=1)
    fill = torch.full_like(x_pad, PLACEHOLDER)
    tokens = torch.where(j < a, x_pad, torch.where(j == a, token, fill))
    return a.squeeze(1), tokens


def spec_verify(draft_tokens, draft_lens, target_logits, draft_probs, uniforms, temperature,
                top_k, top_p):
    """What export modules call. Under ONNX export with the "trt" lowering: one
    `trt_spec::SpecVerify` node (the QDP plugin); otherwise the traceable torch form."""
    if torch.onnx.is_in_onnx_export() and lowering.current() == "trt":
        batch, k = draft_tokens.shape
        return torch.onnx.ops.symbolic_multi_out(
            PLUGIN, [draft_tokens, draft_lens, target_logits, draft_probs, uniforms, temperature,
                     top_k, top_p],
            attrs={}, dtypes=[torch.int64, torch.int64],
            shapes=[[batch], [batch, k + 1]], version=1)
    return spec_verify_torch(draft_tokens, draft_lens, target_logits, draft_probs, uniforms,
                             temperature, top_k, top_p)


class SpecVerify(torch.nn.Module):
    """The op as a module (inputs and outputs as the module docstring): what a standalone
    verify graph traces, under either lowering."""

    def forward(self, draft_tokens, draft_lens, target_logits, draft_probs, uniforms,
                temperature, top_k, top_p):
        return spec_verify(draft_tokens, draft_lens, target_logits, draft_probs, uniforms,
                           temperature, top_k, top_p)


INPUTS = ("draft_tokens", "draft_lens", "target_logits", "draft_probs", "uniforms",
          "temperature", "top_k", "top_p")
OUTPUTS = ("num_accepted", "tokens")


# ---------------------------------------------------------------------------------------------
# Triton kernel (CUDA; importable without triton: triton is imported on first use)
# ---------------------------------------------------------------------------------------------

def spec_verify_triton(draft_tokens, draft_lens, target_logits, draft_probs, uniforms,
                       temperature, top_k=None, top_p=None, out=None, block_v: int = 1024):
    """The Triton kernel on torch CUDA tensors (shapes as spec_verify_torch). `out`: optional
    preallocated (num_accepted [batch] int64, tokens [batch, k + 1] int64), written in place
    (the TensorRT plugin passes its output buffers). Returns (num_accepted, tokens)."""
    from trt_spec.plugins.spec_verify_kernel import spec_verify_kernel  # imports triton

    batch, k = draft_tokens.shape
    vocab = target_logits.shape[-1]
    logits = target_logits
    temperature = sampling_torch.greedy_as_zero(temperature)  # the kernel tests == 0
    if top_k is not None or top_p is not None:  # a logit mask; the kernel then sees -inf there
        t = sampling_torch.temperature_or_one(temperature, temperature == 0)
        masked = sampling_torch.filter_logits(logits.float() / t.view(-1, 1, 1).float(), top_k,
                                              top_p)
        logits = torch.where(torch.isinf(masked), masked, logits.float())
    logits = logits.contiguous()
    if out is None:
        out = (torch.empty(batch, dtype=torch.int64, device=logits.device),
               torch.empty(batch, k + 1, dtype=torch.int64, device=logits.device))
    full_q = draft_probs.shape[-1] != 1
    spec_verify_kernel[(batch,)](
        draft_tokens.to(torch.int64).contiguous(), draft_lens.to(torch.int32).contiguous(), logits,
        draft_probs.contiguous(), uniforms.float().contiguous(), temperature.float().contiguous(),
        out[0], out[1], k, vocab, FULL_Q=full_q,
        BLOCK_V=min(block_v, max(16, 1 << (vocab - 1).bit_length())))
    return out


# ---------------------------------------------------------------------------------------------
# TensorRT: a Quickly Deployable Plugin (tensorrt.plugin), registered on demand
# ---------------------------------------------------------------------------------------------

_REGISTERED = False


def register_trt_plugin() -> None:
    """Registers `trt_spec::SpecVerify` with TensorRT's Python plugin registry (idempotent).
    Call it before parsing a graph that has SpecVerify nodes; needs tensorrt >= 10.6 (QDP),
    torch with CUDA and triton at run time."""
    global _REGISTERED
    if _REGISTERED:
        return
    import tensorrt.plugin as trtp

    @trtp.register(PLUGIN)
    def _desc(draft_tokens: trtp.TensorDesc, draft_lens: trtp.TensorDesc,
              target_logits: trtp.TensorDesc, draft_probs: trtp.TensorDesc,
              uniforms: trtp.TensorDesc, temperature: trtp.TensorDesc, top_k: trtp.TensorDesc,
              top_p: trtp.TensorDesc) -> tuple[trtp.TensorDesc, trtp.TensorDesc]:
        # num_accepted [batch], tokens [batch, k + 1] == uniforms' shape; both int64
        accepted = draft_lens.like()
        accepted.dtype = draft_tokens.dtype
        accepted.shape_expr = trtp.ShapeExprs(1)
        accepted.shape_expr[0] = draft_lens.shape_expr[0]
        tokens = uniforms.like()
        tokens.dtype = draft_tokens.dtype
        return accepted, tokens

    @trtp.impl(PLUGIN)
    def _impl(draft_tokens: trtp.Tensor, draft_lens: trtp.Tensor, target_logits: trtp.Tensor,
              draft_probs: trtp.Tensor, uniforms: trtp.Tensor, temperature: trtp.Tensor,
              top_k: trtp.Tensor, top_p: trtp.Tensor,
              outputs: tuple[trtp.Tensor, trtp.Tensor], stream: int) -> None:
        ins = [torch.as_tensor(t, device="cuda") for t in
               (draft_tokens, draft_lens, target_logits, draft_probs, uniforms, temperature,
                top_k, top_p)]
        outs = tuple(torch.as_tensor(t, device="cuda") for t in outputs)
        with torch.cuda.stream(torch.cuda.ExternalStream(stream)):
            spec_verify_triton(*ins, out=outs)

    _REGISTERED = True
