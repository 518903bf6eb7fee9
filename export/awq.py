"""The AWQ checkpoint layout (AutoAWQ's GEMM version, 4-bit), read and written exactly.

Per quantized nn.Linear (out N, in K, G = K / group_size groups, contiguous along K):

    qweight  int32 [K, N/8]   eight 4-bit codes along the output, in AWQ's order: nibble i
                              (bits 4i) of column j holds output 8j + ORDER[i]
    qzeros   int32 [G, N/8]   the zero points, packed the same way
    scales   fp16  [G, N]
    bias     (optional)

    w[n, k] = scales[k // group_size, n] * (q[k, n] - z[k // group_size, n])

AutoAWQ's GEMV layout (packed along K) and its exllama / marlin conversions are not read.
"""

from __future__ import annotations

import torch

from trt_spec.export.gptq import pack_nibbles, unpack_nibbles
from trt_spec.export.int4_checkpoint import QuantizedLinear

TENSORS = ("qweight", "qzeros", "scales")
REQUIRED = TENSORS
ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i holds output 8j + ORDER[i]
REVERSE = tuple(ORDER.index(c) for c in range(8))  # output 8j + c is in nibble REVERSE[c]


def check_version(qc: dict) -> None:
    version = str(qc.get("version", "gemm")).lower()
    if version != "gemm":
        raise ValueError(f"AWQ version {qc.get('version')!r} is not supported; supported: gemm")
    if qc.get("zero_point") is False:
        raise ValueError("AWQ zero_point=false is not supported (AutoAWQ's GEMM layout always "
                         "stores zero points)")


def from_awq_order(nibbles: torch.Tensor) -> torch.Tensor:
    """[.., N] in packed (nibble) order -> [.., N] in output order."""
    lead = nibbles.shape[:-1]
    return nibbles.reshape(*lead, -1, 8)[..., list(REVERSE)].reshape(*lead, -1)


def to_awq_order(values: torch.Tensor) -> torch.Tensor:
    lead = values.shape[:-1]
    return values.reshape(*lead, -1, 8)[..., list(ORDER)].reshape(*lead, -1)


def unpack(parts: dict[str, torch.Tensor], qc: dict, what: str) -> QuantizedLinear:
    """A module's AWQ tensors (TENSORS) -> QuantizedLinear."""
    check_version(qc)
    qweight, qzeros, scales = parts["qweight"], parts["qzeros"], parts["scales"]
    if qweight.dtype != torch.int32 or qzeros.dtype != torch.int32:
        raise ValueError(f"{what}: qweight / qzeros are {qweight.dtype} / {qzeros.dtype}; "
                         "expected int32 (4-bit AWQ GEMM)")
    k, n = qweight.shape[0], qweight.shape[1] * 8
    group = int(qc.get("group_size", qc.get("q_group_size", 128)))
    group = k if group == -1 else group
    if k % group or tuple(scales.shape) != (k // group, n) \
            or tuple(qzeros.shape) != (k // group, n // 8):
        raise ValueError(f"{what}: qweight {tuple(qweight.shape)}, qzeros "
                         f"{tuple(qzeros.shape)}, scales {tuple(scales.shape)} do not fit group "
                         f"size {group} (expected [{k // group}, {n // 8}] and [{k // group}, {n}])")
    q = from_awq_order(unpack_nibbles(qweight, 1))  # (K, N)
    z = from_awq_order(unpack_nibbles(qzeros, 1))  # (G, N)
    return QuantizedLinear(q.T.contiguous(), z.T.contiguous(),
                           scales.to(torch.float16).T.contiguous(), torch.arange(k) // group,
                           group)


def pack(ql: QuantizedLinear) -> dict[str, torch.Tensor]:
    """QuantizedLinear (groups contiguous along K) -> the module's AWQ GEMM tensors."""
    assert not ql.act_order, "AWQ groups are contiguous along K"
    return {"qweight": pack_nibbles(to_awq_order(ql.q.T.contiguous()), 1),
            "qzeros": pack_nibbles(to_awq_order(ql.zeros.T.contiguous()), 1),
            "scales": ql.scales.T.contiguous()}
