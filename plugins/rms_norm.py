"""RMS norm, alone and fused with the residual add.

Under ONNX export these emit ONNX Runtime's fused kernels (`SimplifiedLayerNormalization`,
`com.microsoft::SkipSimplifiedLayerNormalization`): one node where the plain form is seven.
Under the "trt" lowering they stay the plain form (Pow, ReduceMean, Sqrt, ...), which
TensorRT's parser takes and fuses.
"""

from __future__ import annotations

import torch

from trt_spec.plugins import lowering


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: [..., H]; weight: [H]. Computed in fp32, as transformers' LlamaRMSNorm."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if not torch.onnx.is_in_onnx_export() or lowering.current() == "trt":
        return rms_norm_reference(x, weight, eps)
    return torch.onnx.ops.symbolic(
        "SimplifiedLayerNormalization", [x, weight],
        attrs={"epsilon": float(eps), "axis": -1, "stash_type": 1},
        dtype=x.dtype, shape=x.shape, version=1,
    )


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (rms_norm(x + residual), x + residual). x, residual: [..., H]."""
    if not torch.onnx.is_in_onnx_export() or lowering.current() == "trt":
        total = x + residual
        return rms_norm_reference(total, weight, eps), total
    outs = torch.onnx.ops.symbolic_multi_out(
        "com.microsoft::SkipSimplifiedLayerNormalization", [x, residual, weight],
        attrs={"epsilon": float(eps)},
        dtypes=[x.dtype, torch.float32, torch.float32, x.dtype],
        shapes=[x.shape, [*x.shape[:-1], 1], [*x.shape[:-1], 1], x.shape],  # mean, inv_std_var unused
        version=1,
    )
    return outs[0], outs[3]
