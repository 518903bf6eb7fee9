"""The GPTQ checkpoint layout (AutoGPTQ / GPTQModel, 4-bit), read and written exactly.

Per quantized nn.Linear (out N, in K, G groups):

    qweight  int32 [K/8, N]   eight 4-bit codes along the input, feature k in bits 4*(k % 8)
                              of row k // 8
    qzeros   int32 [G, N/8]   eight 4-bit zero points along the output, column n in bits
                              4*(n % 8) of column n // 8
    scales   fp16  [G, N]
    g_idx    int32 [K]        the group of each input feature (k // group_size, or GPTQ's
                              activation order under desc_act); optional in some exports
    bias     (optional, fp16; kept as the module's bias)

    w[n, k] = scales[g_idx[k], n] * (q[k, n] - z[g_idx[k], n])

The old format (checkpoint_format "gptq", AutoGPTQ's, and every folder that does not say
"gptq_v2") stores z - 1: its kernels read z = (stored + 1) & 15 (the mask matters: AutoGPTQ
packs z = 0 as 15). GPTQModel's "gptq_v2" stores z. Symmetric checkpoints (sym=true) store the
middle code, z = 8, in the same tensor: nothing differs when reading them.
"""

from __future__ import annotations

import torch

from trt_spec.export.int4_checkpoint import QuantizedLinear

TENSORS = ("qweight", "qzeros", "scales", "g_idx")
REQUIRED = ("qweight", "qzeros", "scales")
SHIFTS = torch.arange(0, 32, 4, dtype=torch.int32)  # nibble i of an int32 at bits 4i


def is_v1(qc: dict) -> bool:
    """Whether the zero points are stored as z - 1 (the old format)."""
    fmt = str(qc.get("checkpoint_format", "gptq")).lower()
    if fmt not in ("gptq", "gptq_v2"):
        raise ValueError(f"GPTQ checkpoint_format {qc.get('checkpoint_format')!r} is not "
                         "supported; supported: gptq, gptq_v2")
    return fmt == "gptq"


def unpack_nibbles(packed: torch.Tensor, dim: int) -> torch.Tensor:
    """int32 [.., M, ..] -> uint8 4-bit values [.., 8M, ..], eight per int32 spread along
    `dim` (0 or 1), the low nibble first."""
    assert dim in (0, 1), dim
    x = packed.to(torch.int32).unsqueeze(dim + 1)  # (.., M, 1, ..)
    shape = [1] * x.dim()
    shape[dim + 1] = 8
    return ((x >> SHIFTS.view(shape)) & 0xF).flatten(dim, dim + 1).to(torch.uint8)


def pack_nibbles(values: torch.Tensor, dim: int) -> torch.Tensor:
    """Inverse of unpack_nibbles: uint8 0..15 [.., 8M, ..] -> int32 [.., M, ..]."""
    assert dim in (0, 1) and values.shape[dim] % 8 == 0, (dim, values.shape)
    v = values.to(torch.int64).unflatten(dim, (values.shape[dim] // 8, 8))
    shape = [1] * v.dim()
    shape[dim + 1] = 8
    word = (v << SHIFTS.to(torch.int64).view(shape)).sum(dim + 1)
    return torch.where(word >= 2 ** 31, word - 2 ** 32, word).to(torch.int32)  # as int32 bits


def unpack(parts: dict[str, torch.Tensor], qc: dict, what: str) -> QuantizedLinear:
    """A module's GPTQ tensors (TENSORS) -> QuantizedLinear."""
    qweight, qzeros, scales = parts["qweight"], parts["qzeros"], parts["scales"]
    if qweight.dtype != torch.int32 or qzeros.dtype != torch.int32:
        raise ValueError(f"{what}: qweight / qzeros are {qweight.dtype} / {qzeros.dtype}; "
                         "expected int32 (4-bit GPTQ)")
    k, n = qweight.shape[0] * 8, qweight.shape[1]
    groups = scales.shape[0]
    if tuple(scales.shape) != (groups, n) or tuple(qzeros.shape) != (groups, n // 8):
        raise ValueError(f"{what}: scales {tuple(scales.shape)} / qzeros "
                         f"{tuple(qzeros.shape)} do not match qweight {tuple(qweight.shape)} "
                         f"(expected [G, {n}] / [G, {n // 8}])")
    group = qc.get("group_size", 128)
    group = k if group in (-1, None) else int(group)
    g_idx = parts.get("g_idx")
    g_idx = (torch.arange(k) // group) if g_idx is None else g_idx.to(torch.int64)
    if tuple(g_idx.shape) != (k,) or int(g_idx.min()) < 0 or int(g_idx.max()) >= groups:
        raise ValueError(f"{what}: g_idx {tuple(g_idx.shape)} with groups "
                         f"{int(g_idx.min())}..{int(g_idx.max())}; expected [{k}] in 0..{groups - 1}")
    q = unpack_nibbles(qweight, 0).T.contiguous()  # (N, K)
    z = unpack_nibbles(qzeros, 1)  # (G, N)
    if is_v1(qc):
        z = (z + 1) & 0xF
    return QuantizedLinear(q, z.T.contiguous(), scales.to(torch.float16).T.contiguous(), g_idx,
                           group)


def pack(ql: QuantizedLinear, v1: bool = False) -> dict[str, torch.Tensor]:
    """QuantizedLinear -> the module's GPTQ tensors (v1: zero points stored as z - 1)."""
    z = ql.zeros.T.contiguous()  # (G, N)
    if v1:
        z = (z.to(torch.int16) - 1) & 0xF
    return {"qweight": pack_nibbles(ql.q.T.contiguous(), 0),
            "qzeros": pack_nibbles(z.to(torch.uint8), 1),
            "scales": ql.scales.T.contiguous(),
            "g_idx": ql.g_idx.to(torch.int32)}
