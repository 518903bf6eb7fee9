"""Quantizing a target to 4 bits in the GPTQ checkpoint layout: round-to-nearest, or GPTQ's
error feedback (Frantar et al., "GPTQ: Accurate Post-Training Quantization for Generative
Pre-trained Transformers", 2022), written as a GPTQ folder that `trt-spec export` reads
exactly (export/int4_checkpoint.py).

    the grid      per group of `group` input features and per output row: GPTQ's min/max
                  grid, widened to include 0 (asymmetric: scale = (max - min) / 15, integer
                  zero z = round(-min / scale); symmetric: z = 8), the scale rounded to fp16
                  first so that the codes are chosen on the grid the checkpoint stores
    RTN           each weight to its nearest code
    GPTQ          the input features in turn (by decreasing Hessian diagonal under
                  act_order); each one's rounding error, weighted by the inverse Hessian
                  H^-1 = (2 X^T X + damp I)^-1 of the layer's calibration inputs X, is
                  moved onto the features not yet quantized (lazy batches of 128)
    sequential    layer by layer: layer i's Hessians are measured on the calibration text
                  with layers < i already quantized (their outputs are layer i's inputs),
                  all four of its MatMuls at once (qkv / gate_up read one input each)

The target's fused weights are quantized whole (GPTQ treats each output row on its own, so
q/k/v together is q, k and v apart) and split back into the checkpoint's modules.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from trt_spec.export.int4_checkpoint import FUSED, QuantizedLinear, parts_of

MAXQ = 15


def grid(w: torch.Tensor, sym: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, g] (one group of every row) -> (scale [N] fp16, zero [N] uint8): GPTQ's
    min/max grid, including 0, the scale rounded to fp16."""
    lo = w.min(1).values.clamp(max=0)
    hi = w.max(1).values.clamp(min=0)
    if sym:
        hi = torch.maximum(lo.abs(), hi)
        lo = torch.where(lo < 0, -hi, lo)
    both_zero = (lo == 0) & (hi == 0)
    lo, hi = torch.where(both_zero, -1.0, lo), torch.where(both_zero, 1.0, hi)
    scale = ((hi - lo) / MAXQ).half()
    scale = torch.where(scale == 0, torch.finfo(torch.float16).tiny, scale)  # fp16 underflow
    zero = torch.full_like(lo, (MAXQ + 1) // 2) if sym else torch.round(-lo / scale.float())
    return scale, zero.clamp(0, MAXQ).to(torch.uint8)


def quantize_codes(w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """w [N, ...] -> codes [N, ...] uint8 on the grid (scale, zero [N])."""
    shape = (-1,) + (1,) * (w.dim() - 1)
    q = torch.round(w / scale.float().view(shape)) + zero.float().view(shape)
    return q.clamp(0, MAXQ).to(torch.uint8)


def rtn(w: torch.Tensor, group: int, sym: bool = False) -> QuantizedLinear:
    """w [N, K] fp32 -> round-to-nearest codes, groups of `group` along K."""
    n, k = w.shape
    assert k % group == 0, (k, group)
    wg = w.float().reshape(n, k // group, group)
    scales, zeros = zip(*(grid(wg[:, j], sym) for j in range(k // group)))
    scale, zero = torch.stack(scales, 1), torch.stack(zeros, 1)  # (N, G)
    q = torch.round(wg / scale.float()[..., None]) + zero.float()[..., None]
    return QuantizedLinear(q.clamp(0, MAXQ).to(torch.uint8).reshape(n, k), zero, scale,
                           torch.arange(k) // group, group)


def gptq(w: torch.Tensor, hessian: torch.Tensor, group: int, sym: bool = False,
         act_order: bool = False, damp: float = 0.01, batch: int = 128) -> QuantizedLinear:
    """w [N, K] fp32, hessian [K, K] (sum of x x^T over the calibration inputs) -> codes by
    GPTQ's error feedback. Dead inputs (H_kk = 0) are quantized as they are. Runs on one
    thread: the loop is thousands of small ops, for which a thread pool's synchronization
    costs more than it gives (10x slower on 2 busy cores)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _gptq(w, hessian, group, sym, act_order, damp, batch)
    finally:
        torch.set_num_threads(threads)


def _gptq(w, hessian, group: int, sym: bool, act_order: bool, damp: float, batch: int
          ) -> QuantizedLinear:
    n, k = w.shape
    assert k % group == 0, (k, group)
    w = w.clone().float()
    h = hessian.clone().float()
    dead = torch.diag(h) == 0
    h[dead, dead] = 1
    perm = torch.argsort(torch.diag(h), descending=True) if act_order else torch.arange(k)
    w, h = w[:, perm], h[perm][:, perm]
    h += damp * torch.mean(torch.diag(h)) * torch.eye(k)
    hinv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True)
    q = torch.zeros(n, k, dtype=torch.uint8)
    scales = torch.zeros(n, k // group, dtype=torch.float16)
    zeros = torch.zeros(n, k // group, dtype=torch.uint8)
    for b0 in range(0, k, batch):
        b1 = min(b0 + batch, k)
        wb = w[:, b0:b1].clone()
        err = torch.zeros_like(wb)
        hb = hinv[b0:b1, b0:b1]
        for j in range(b1 - b0):
            col = b0 + j
            if col % group == 0:  # a new group: its grid from the weights as updated so far
                g = col // group
                scales[:, g], zeros[:, g] = grid(torch.cat([wb[:, j:], w[:, b1:]], 1)
                                                 [:, :group], sym)
            g = col // group
            qc = quantize_codes(wb[:, j], scales[:, g], zeros[:, g])
            q[:, col] = qc
            deq = scales[:, g].float() * (qc.float() - zeros[:, g].float())
            e = (wb[:, j] - deq) / hb[j, j]
            wb[:, j:] -= e[:, None] * hb[j, j:][None]
            err[:, j] = e
        w[:, b1:] -= err @ hinv[b0:b1, b1:]
    inverse = torch.argsort(perm)
    g_idx = (torch.arange(k) // group)[inverse]  # feature perm[i] is in group i // group
    return QuantizedLinear(q[:, inverse].contiguous(), zeros, scales, g_idx, group)


# --- a target, layer by layer -----------------------------------------------------------

def layer_forward(target, i: int, h: torch.Tensor) -> torch.Tensor:
    """Layer i of the target on one sequence from an empty cache: residual h [1, T, H] ->
    the layer's output residual [1, T, H]."""
    from trt_spec.export.model import layer_rope
    from trt_spec.plugins.rms_norm import rms_norm

    c = target.config
    layer = target.layers[i]
    t = h.shape[1]
    positions = torch.arange(t)[None]
    shape = (1, c.num_kv_heads, t, c.head_dim)
    x = rms_norm(h, layer.input_layernorm, c.rms_norm_eps)
    a, _, _ = layer.attend(x, torch.zeros(shape), torch.zeros(shape),
                           torch.tensor([t - 1], dtype=torch.int32),
                           torch.tensor([t], dtype=torch.int32), positions,
                           torch.tensor(t, dtype=torch.int32), *layer_rope(target, c, i))
    _, h = layer.residual(a, h, torch.ones(c.hidden_size))
    return h


@torch.inference_mode()
def layer_hessians(target, i: int, inputs: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """{linear name: sum over the calibration tokens of x x^T [K, K] fp32} for layer i."""
    layer = target.layers[i]
    sums: dict[str, torch.Tensor] = {}
    hooks = []
    for name in FUSED:
        def record(mod, args, out, name=name):
            x = args[0].detach().flatten(0, -2).float()  # (tokens, K)
            sums[name] = sums.get(name, 0) + x.T @ x
        hooks.append(getattr(layer, name).register_forward_hook(record))
    try:
        for h in inputs:
            layer_forward(target, i, h)
    finally:
        for hook in hooks:
            hook.remove()
    return sums


@torch.inference_mode()
def quantize_target(target, sequences: list[list[int]] | None, group: int, sym: bool = False,
                    act_order: bool = False, progress=print) -> dict[str, QuantizedLinear]:
    """The target's layer MatMuls -> {fused name "layers.i.qkv_proj": QuantizedLinear}, by
    GPTQ on `sequences` (token ids of calibration text), or by RTN when None. The target's
    weights are replaced by their dequantized values as it goes (sequential GPTQ)."""
    from trt_spec.export.int4_checkpoint import dequantize

    c = target.config
    inputs = None
    if sequences is not None:
        inputs = [target.embed_tokens(torch.tensor(s)[None]) * c.embed_scale for s in sequences]
    out = {}
    t0 = time.time()
    for i, layer in enumerate(target.layers):
        hessians = layer_hessians(target, i, inputs) if inputs is not None else {}
        for name in FUSED:
            linear = getattr(layer, name)
            w = linear.weight.detach().float()
            ql = (gptq(w, hessians[name], group, sym, act_order) if inputs is not None
                  else rtn(w, group, sym))
            linear.weight.copy_(dequantize(ql))
            out[f"layers.{i}.{name}"] = ql
        if inputs is not None:
            inputs = [layer_forward(target, i, h) for h in inputs]
        progress(f"  layer {i + 1}/{c.num_layers} quantized ({time.time() - t0:.0f} s)")
    return out


def split(ql: QuantizedLinear, sizes: list[int]) -> list[QuantizedLinear]:
    """A fused weight's codes -> its modules' (along N), as target_state_dict fused them."""
    return [QuantizedLinear(q, z, s, ql.g_idx, ql.group_size) for q, z, s in
            zip(ql.q.split(sizes), ql.zeros.split(sizes), ql.scales.split(sizes))]


def module_sizes(config) -> dict[str, list[int]]:
    c = config
    return {"qkv_proj": [c.num_heads * c.head_dim] + [c.num_kv_heads * c.head_dim] * 2,
            "o_proj": [c.hidden_size],
            "gate_up_proj": [c.intermediate_size] * 2,
            "down_proj": [c.hidden_size]}


def gptq_config(group: int, sym: bool, act_order: bool, v1: bool = True) -> dict:
    """The quantization_config a GPTQ folder's config.json carries."""
    return {"quant_method": "gptq", "bits": 4, "group_size": group, "sym": sym,
            "desc_act": act_order, "checkpoint_format": "gptq" if v1 else "gptq_v2"}


def awq_config(group: int) -> dict:
    return {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True,
            "version": "gemm"}


def write_folder(hf_dir: Path, out: Path, codes: dict[str, QuantizedLinear], config,
                 qc: dict) -> Path:
    """A GPTQ / AWQ folder (qc: gptq_config or awq_config): hf_dir's config with
    quantization_config, its tokenizer files and non-quantized tensors (in their own dtype:
    only the quantizer differs from hf_dir), and `codes` split into the checkpoint's modules
    in qc's layout; written atomically."""
    import shutil

    from safetensors.torch import save_file

    from trt_spec.export import awq, gptq
    from trt_spec.export.checkpoint import read_safetensors
    from trt_spec.runtime.files import atomic_folder

    if qc["quant_method"] == "gptq":
        v1 = gptq.is_v1(qc)
        pack = lambda ql: gptq.pack(ql, v1=v1)  # noqa: E731
    else:
        pack = awq.pack
    hf_dir = Path(hf_dir)
    sizes = module_sizes(config)
    tensors = read_safetensors(hf_dir)
    for name, ql in codes.items():
        i, fused = name.split(".")[1], name.split(".")[2]
        parts = parts_of(fused, lambda p: f"model.layers.{i}.{p}.weight" in tensors)
        pieces = split(ql, sizes[fused]) if len(parts) > 1 else [ql]
        for part, piece in zip(parts, pieces):
            prefix = f"model.layers.{i}.{part}"
            del tensors[prefix + ".weight"]
            tensors.update({f"{prefix}.{key}": value for key, value in pack(piece).items()})
    hf = json.loads((hf_dir / "config.json").read_text())
    hf["quantization_config"] = qc
    with atomic_folder(out) as tmp:
        save_file(tensors, tmp / "model.safetensors", metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(hf, indent=2) + "\n")
        for f in hf_dir.iterdir():
            if f.name not in ("config.json", "model.safetensors", "model.safetensors.index.json",
                              "source.json") and f.is_file():
                shutil.copy(f, tmp / f.name)
    return out
