"""SpecVerify: the speculative verifier as one op, so a score graph returns tokens, not logits.

Same semantics and vocabulary as runtime/verify.py (accepted, recovered, bonus; p = target,
q = draft), drafter-invariant: the target's token at output position i of a row with seed s
is the exponential race of (s, i) over p_i (runtime/race.py), a pure function of its inputs.
Per row b with n = draft_lens[b] valid drafts x_0..x_{n-1}, from output position
position[b]:

    t_i = argmax(logits[b, i])                    greedy (temperature[b] below
                                                  GREEDY_TEMPERATURE, 1e-5, as
                                                  runtime/sampling.py: taken as 0 on entry)
    t_i = argmin_v E(seed[b], position[b] + i, v) / p_i(v)   else; p_i = softmax(filter(
                                                  logits[b, i] / T)), top-k then top-p,
                                                  exactly as runtime.sampling.probs_from_logits
    accept the longest prefix with x_i == t_i (a accepted); the next token is t_a.

No q is read: a model drafter couples by drawing its drafts with the same noise. The op is
runtime/device/verify.py's `verify`, the device loop's own (one torch function), and its
reference is the host's verify_batch: the two agree token for token on the same logits.

    inputs                                          outputs
    draft_tokens  [batch, k] int64                  num_accepted [batch] int64
    draft_lens    [batch] int32 (0..k valid drafts) tokens       [batch, k + 1] int64
    target_logits [batch, k + 1, vocab] float           row b: accepted drafts, then the
    seed          [batch] int64 (uint64 bits)           recovered / bonus token, then
    position      [batch] int64 (output position        PLACEHOLDER (-1)
                  of row 0: the output's length)
    temperature   [batch] float (0, or below 1e-5: greedy row)
    top_k         [batch] int32 (0: off)
    top_p         [batch] float (1: off)

Faces:
- `spec_verify_reference`: NumPy, per row, float64: runtime/verify.py's verify_batch (the
  host loop's rule, the definition).
- `spec_verify_torch`: runtime/device/verify.py's `verify` on the op's inputs; pure torch,
  batched, any device; traceable, so tracing it is the op's ONNX Runtime lowering (standard
  ONNX ops: ArgMax, TopK, Softmax, the hash's BitwiseXor / BitShift / Mul, Log, ...).
- `spec_verify`: what export modules call: under ONNX export with the "trt" lowering it emits
  one `trt_spec::SpecVerify` node (the TensorRT plugin below), else it is `spec_verify_torch`.
- `spec_verify_triton`: the Triton kernel (one program per row, the race's hash in uint64),
  shared by the TensorRT plugin and the torch-CUDA backend; top-k / top-p are applied as a
  logit mask in torch first.
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
from trt_spec.runtime.device.verify import verify
from trt_spec.runtime.race import MASK
from trt_spec.runtime.sampling import SamplingParams
from trt_spec.runtime.verify import PLACEHOLDER, verify_batch

PLUGIN = "trt_spec::SpecVerify"


# ---------------------------------------------------------------------------------------------
# NumPy reference: the host's rule
# ---------------------------------------------------------------------------------------------

def spec_verify_reference(draft_tokens, draft_lens, target_logits, seed, position, temperature,
                          top_k=None, top_p=None) -> tuple[np.ndarray, np.ndarray]:
    """Shapes as the module docstring. Returns (num_accepted [batch], tokens [batch, k + 1]):
    runtime/verify.py's verify_batch, row by row."""
    draft_tokens = np.asarray(draft_tokens, dtype=np.int64)
    batch, k = draft_tokens.shape
    assert target_logits.shape[:2] == (batch, k + 1), (target_logits.shape, draft_tokens.shape)
    top_k = np.zeros(batch, np.int64) if top_k is None else np.asarray(top_k)
    top_p = np.ones(batch) if top_p is None else np.asarray(top_p)
    lens = [int(n) for n in draft_lens]
    assert all(0 <= n <= k for n in lens), (lens, k)
    params = [SamplingParams(temperature=float(temperature[b]), top_k=int(top_k[b]),
                             top_p=float(top_p[b]), seed=int(seed[b]) & MASK)
              for b in range(batch)]
    out = verify_batch([draft_tokens[b, :n] for b, n in enumerate(lens)],
                       [np.asarray(target_logits[b, :n + 1]) for b, n in enumerate(lens)],
                       params, [int(i) for i in position])
    tokens = np.full((batch, k + 1), PLACEHOLDER, np.int64)
    tokens[:, :out.tokens.shape[1]] = out.tokens
    return out.num_accepted, tokens


# ---------------------------------------------------------------------------------------------
# torch (any device; its trace is the ONNX Runtime lowering)
# ---------------------------------------------------------------------------------------------

def spec_verify_torch(
    draft_tokens: torch.Tensor,  # [batch, k] int64
    draft_lens: torch.Tensor,  # [batch] int32
    target_logits: torch.Tensor,  # [batch, k + 1, vocab]
    seed: torch.Tensor,  # [batch] int64
    position: torch.Tensor,  # [batch] int64
    temperature: torch.Tensor,  # [batch]
    top_k: torch.Tensor | None = None,  # [batch] int32
    top_p: torch.Tensor | None = None,  # [batch]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Batched SpecVerify: (num_accepted [batch] int64, tokens [batch, k + 1] int64), by
    runtime/device/verify.py's `verify` (the device loop's)."""
    x = draft_tokens.to(torch.int64)
    temperature = sampling_torch.greedy_as_zero(temperature)
    valid = torch.arange(x.shape[1], device=x.device)[None] < draft_lens.to(torch.int64)[:, None]
    tokens, accepted = verify(x, valid, target_logits, temperature, top_k, top_p,
                              temperature == 0, seed.to(torch.int64), position.to(torch.int64))
    return accepted, tokens


def spec_verify(draft_tokens, draft_lens, target_logits, seed, position, temperature, top_k,
                top_p):
    """What export modules call. Under ONNX export with the "trt" lowering: one
    `trt_spec::SpecVerify` node (the QDP plugin); otherwise the traceable torch form."""
    if torch.onnx.is_in_onnx_export() and lowering.current() == "trt":
        batch, k = draft_tokens.shape
        return torch.onnx.ops.symbolic_multi_out(
            PLUGIN, [draft_tokens, draft_lens, target_logits, seed, position, temperature,
                     top_k, top_p],
            attrs={}, dtypes=[torch.int64, torch.int64],
            shapes=[[batch], [batch, k + 1]], version=1)
    return spec_verify_torch(draft_tokens, draft_lens, target_logits, seed, position,
                             temperature, top_k, top_p)


class SpecVerify(torch.nn.Module):
    """The op as a module (inputs and outputs as the module docstring): what a standalone
    verify graph traces, under either lowering."""

    def forward(self, draft_tokens, draft_lens, target_logits, seed, position, temperature,
                top_k, top_p):
        return spec_verify(draft_tokens, draft_lens, target_logits, seed, position,
                           temperature, top_k, top_p)


INPUTS = ("draft_tokens", "draft_lens", "target_logits", "seed", "position", "temperature",
          "top_k", "top_p")
OUTPUTS = ("num_accepted", "tokens")


# ---------------------------------------------------------------------------------------------
# Triton kernel (CUDA; importable without triton: triton is imported on first use)
# ---------------------------------------------------------------------------------------------

def spec_verify_triton(draft_tokens, draft_lens, target_logits, seed, position, temperature,
                       top_k=None, top_p=None, out=None, block_v: int = 1024):
    """The Triton kernel on torch CUDA tensors (shapes as spec_verify_torch). `out`: optional
    preallocated (num_accepted [batch] int64, tokens [batch, k + 1] int64), written in place
    (the TensorRT plugin passes its output buffers). Returns (num_accepted, tokens)."""
    from trt_spec.plugins.spec_verify_kernel import spec_verify_kernel  # imports triton

    batch, k = draft_tokens.shape
    vocab = target_logits.shape[-1]
    logits = target_logits
    temperature = sampling_torch.greedy_as_zero(temperature)  # the kernel tests == 0
    if top_k is not None or top_p is not None:  # a logit mask; the kernel then sees -inf there
        t = sampling_torch.temperature_or_one(temperature, temperature == 0).to(torch.float64)
        masked = sampling_torch.filter_logits(logits.double() / t.view(-1, 1, 1), top_k, top_p)
        logits = torch.where(torch.isinf(masked), float("-inf"), logits.float())
    logits = logits.contiguous()
    if out is None:
        out = (torch.empty(batch, dtype=torch.int64, device=logits.device),
               torch.empty(batch, k + 1, dtype=torch.int64, device=logits.device))
    spec_verify_kernel[(batch,)](
        draft_tokens.to(torch.int64).contiguous(), draft_lens.to(torch.int32).contiguous(), logits,
        seed.to(torch.int64).contiguous(), position.to(torch.int64).contiguous(),
        temperature.float().contiguous(), out[0], out[1], k, vocab,
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
              target_logits: trtp.TensorDesc, seed: trtp.TensorDesc, position: trtp.TensorDesc,
              temperature: trtp.TensorDesc, top_k: trtp.TensorDesc,
              top_p: trtp.TensorDesc) -> tuple[trtp.TensorDesc, trtp.TensorDesc]:
        # num_accepted [batch], tokens [batch, k + 1] (target_logits' first two axes); int64
        accepted = draft_lens.like()
        accepted.dtype = draft_tokens.dtype
        accepted.shape_expr = trtp.ShapeExprs(1)
        accepted.shape_expr[0] = draft_lens.shape_expr[0]
        tokens = target_logits.like()
        tokens.dtype = draft_tokens.dtype
        tokens.shape_expr = trtp.ShapeExprs(2)
        tokens.shape_expr[0] = target_logits.shape_expr[0]
        tokens.shape_expr[1] = target_logits.shape_expr[1]
        return accepted, tokens

    @trtp.impl(PLUGIN)
    def _impl(draft_tokens: trtp.Tensor, draft_lens: trtp.Tensor, target_logits: trtp.Tensor,
              seed: trtp.Tensor, position: trtp.Tensor, temperature: trtp.Tensor,
              top_k: trtp.Tensor, top_p: trtp.Tensor,
              outputs: tuple[trtp.Tensor, trtp.Tensor], stream: int) -> None:
        ins = [torch.as_tensor(t, device="cuda") for t in
               (draft_tokens, draft_lens, target_logits, seed, position, temperature, top_k,
                top_p)]
        outs = tuple(torch.as_tensor(t, device="cuda") for t in outputs)
        with torch.cuda.stream(torch.cuda.ExternalStream(stream)):
            spec_verify_triton(*ins, out=outs)

    _REGISTERED = True
