"""Quantized Hugging Face checkpoints (GPTQ, AWQ) read exactly: integer codes, integer zero
points and fp16 scales, as the checkpoint stores them.

    QuantizedLinear   one nn.Linear's codes q [N, K], zeros [N, G] and scales [N, G] (fp16),
                      and g_idx [K] (the group of each input feature; the identity ordering
                      k // group unless GPTQ's desc_act reordered it)
    dequantize        w [N, K] fp32 = scales[:, g_idx] * (q - zeros[:, g_idx]): exact in fp32
                      (an 11-bit scale times an integer of |q - z| <= 15), so its fp16 rounding
                      is bitwise what a checkpoint's fp16 kernel computes
    read_quantized    a folder's tensors -> (the state dict with `<prefix>.weight` in fp32 in
                      place of each quantized module's tensors, {prefix: QuantizedLinear})
    fused_codes       the codes of the target's fused weights (qkv_proj = q, k, v; gate_up_proj
                      = gate, up), keyed by the bytes of the fp32 [K, N] MatMul weight the
                      exported graph holds (content_key): export/quantize.py matmuls_to_nbits
                      writes them into MatMulNBits unchanged instead of quantizing again
    nbits_weights     a QuantizedLinear -> MatMulNBits' initializers: block size = group size,
                      the integer zero points as they are, and, where g_idx is not the identity
                      ordering, the input permutation that makes each group contiguous (the
                      graph gathers the activations in that order: MatMulNBits' own g_idx input
                      leaves ORT's fast int4 path, docs/quantization.md)
    checkpoint_matmul one MatMul of the graph -> that MatMulNBits (matmuls_to_nbits' `given`)

The layouts themselves are in export/gptq.py and export/awq.py.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

MIN_BLOCK, MAX_BLOCK = 16, 256  # MatMulNBits' block sizes: powers of two in this range


@dataclass(frozen=True)
class QuantizedLinear:
    """One nn.Linear (out N, in K) as a 4-bit checkpoint stores it, unpacked."""

    q: torch.Tensor  # [N, K] uint8 codes, 0..15, input features in their natural order
    zeros: torch.Tensor  # [N, G] uint8 integer zero points, 0..15
    scales: torch.Tensor  # [N, G] float16
    g_idx: torch.Tensor  # [K] int64: the group of each input feature
    group_size: int  # input features per group (K when the checkpoint has one group a row)

    def __post_init__(self):
        n, k = self.q.shape
        assert self.zeros.shape == self.scales.shape and self.zeros.shape[0] == n, \
            (self.q.shape, self.zeros.shape, self.scales.shape)
        assert self.g_idx.shape == (k,), (self.g_idx.shape, k)
        assert self.scales.dtype == torch.float16, self.scales.dtype

    @property
    def act_order(self) -> bool:
        """Whether g_idx is not the identity ordering k // group_size (GPTQ's desc_act)."""
        k = self.q.shape[1]
        return not torch.equal(self.g_idx, torch.arange(k) // self.group_size)


def dequantize(ql: QuantizedLinear) -> torch.Tensor:
    """[N, K] fp32 = scales[:, g_idx] * (q - zeros[:, g_idx]). Every product is exact in fp32,
    so w.half() is bitwise the fp16 kernels' scales * (q - z) (one correctly rounded product)."""
    g = ql.g_idx
    return ql.scales.float()[:, g] * (ql.q.float() - ql.zeros.float()[:, g])


# --- the folder's quantization config --------------------------------------------------

def quantization_config(folder: Path, hf: dict) -> dict | None:
    """The checkpoint's quantization settings, or None for a plain one: config.json's
    quantization_config, else quantize_config.json (AutoGPTQ), else quant_config.json
    (AutoAWQ). Keys as found, plus quant_method ("gptq" | "awq")."""
    folder = Path(folder)
    if isinstance(hf.get("quantization_config"), dict):
        qc = dict(hf["quantization_config"])
    elif (folder / "quantize_config.json").is_file():
        qc = {"quant_method": "gptq", **json.loads((folder / "quantize_config.json").read_text())}
    elif (folder / "quant_config.json").is_file():
        qc = {"quant_method": "awq", **json.loads((folder / "quant_config.json").read_text())}
    else:
        return None
    method = str(qc.get("quant_method", "")).lower()
    if method not in ("gptq", "awq"):
        raise ValueError(f"{folder}: quant_method {qc.get('quant_method')!r} is not supported; "
                         "supported: gptq, awq")
    qc["quant_method"] = method
    bits = qc.get("bits", qc.get("w_bit"))
    if bits != 4:
        raise ValueError(f"{folder}: {method} bits={bits!r}; only 4-bit checkpoints are read")
    return qc


def read_quantized(tensors: dict[str, torch.Tensor], qc: dict, source: str,
                   attention_bias: bool = False
                   ) -> tuple[dict[str, torch.Tensor], dict[str, QuantizedLinear]]:
    """The tensors of a GPTQ / AWQ folder -> (the same state with `<prefix>.weight` (fp32,
    dequantize) in place of each quantized module's tensors, {prefix: QuantizedLinear}).
    Every module with a `.qweight` is read; its other tensors must all be there. AutoGPTQ
    writes an all-zero bias for bias-free modules: those are dropped, except q/k/v's where the
    family has attention biases (`attention_bias`)."""
    from trt_spec.export import awq, gptq

    layout = gptq if qc["quant_method"] == "gptq" else awq
    state = dict(tensors)
    codes = {}
    for key in sorted(k for k in tensors if k.endswith(".qweight")):
        prefix = key[:-len(".qweight")]
        if prefix.endswith("lm_head"):
            raise ValueError(f"{source}: a quantized lm_head ({key}) is not supported; "
                             "quantize the body only")
        parts = {name: state.pop(f"{prefix}.{name}") for name in layout.TENSORS
                 if f"{prefix}.{name}" in state}
        missing = [f"{prefix}.{name}" for name in layout.REQUIRED if name not in parts]
        if missing:
            raise KeyError(f"{source}: checkpoint is missing {missing}")
        codes[prefix] = layout.unpack(parts, qc, f"{source}: {prefix}")
        state[f"{prefix}.weight"] = dequantize(codes[prefix])
        bias = state.get(f"{prefix}.bias")
        keep = attention_bias and prefix.rsplit(".", 1)[-1] in ("q_proj", "k_proj", "v_proj")
        if bias is not None and not keep and not bias.any():
            del state[f"{prefix}.bias"]
    if not codes:
        raise ValueError(f"{source}: quant_method {qc['quant_method']!r} but no .qweight tensor")
    return state, codes


# --- into the exported graph ------------------------------------------------------------

# The target's fused weights (export/checkpoint.py target_state_dict): name -> its parts
FUSED = {"qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
         "o_proj": ("self_attn.o_proj",),
         "gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
         "down_proj": ("mlp.down_proj",)}
# ... or stored already fused, as one module (Phi-3's qkv_proj and gate_up_proj)
STORED_FUSED = {"qkv_proj": ("self_attn.qkv_proj",), "gate_up_proj": ("mlp.gate_up_proj",)}


def parts_of(name: str, stored) -> tuple[str, ...]:
    """The checkpoint's modules that make the target's fused weight `name`: its one fused
    module where `stored(part)` says the checkpoint has it (Phi-3), else FUSED's parts."""
    fused = STORED_FUSED.get(name)
    return fused if fused and stored(fused[0]) else FUSED[name]


def content_key(w_kn: np.ndarray) -> str:
    """The key of a MatMul weight [K, N] fp32: a digest of its bytes (the graph's initializer
    after tracing, matched to the checkpoint's codes without depending on its name)."""
    w = np.ascontiguousarray(w_kn, dtype=np.float32)
    return hashlib.sha256(repr(w.shape).encode() + w.tobytes()).hexdigest()


def fuse(parts: list[QuantizedLinear], name: str) -> QuantizedLinear:
    """Modules concatenated along N (their outputs), as the target fuses q/k/v and gate/up.
    They must share the input grouping (g_idx), which GPTQ gives modules that read one input."""
    first = parts[0]
    for p in parts[1:]:
        if p.group_size != first.group_size or not torch.equal(p.g_idx, first.g_idx):
            raise ValueError(f"{name}: the fused modules have different g_idx / group sizes; "
                             "modules that read one input must share their input order")
    return QuantizedLinear(torch.cat([p.q for p in parts]), torch.cat([p.zeros for p in parts]),
                           torch.cat([p.scales for p in parts]), first.g_idx, first.group_size)


def fused_codes(codes: dict[str, QuantizedLinear], num_layers: int, source: str
                ) -> dict[str, QuantizedLinear]:
    """{content_key of the fused weight's [K, N]: QuantizedLinear} for every quantized layer
    weight of the target. A fused weight is quantized whole or not at all."""
    out = {}
    used = set()
    for i in range(num_layers):
        for name in FUSED:
            parts = parts_of(name, lambda p: f"model.layers.{i}.{p}" in codes)
            prefixes = [f"model.layers.{i}.{p}" for p in parts]
            have = [p in codes for p in prefixes]
            if not any(have):
                continue
            if not all(have):
                raise ValueError(f"{source}: layer {i} {name}: some of {prefixes} are quantized "
                                 "and some not; fused weights must be quantized alike")
            ql = fuse([codes[p] for p in prefixes], f"{source}: layer {i} {name}")
            used.update(prefixes)
            out[content_key(dequantize(ql).T.numpy())] = ql
    unknown = sorted(set(codes) - used)
    if unknown:
        raise KeyError(f"{source}: quantized modules the target does not have: {unknown[:8]}")
    return out


def block_size(ql: QuantizedLinear) -> int:
    """MatMulNBits' block: the group size, or the largest power of two in [16, 256] that
    divides it and K (a group then spans several blocks with the same scale and zero point)."""
    k = ql.q.shape[1]
    for b in (256, 128, 64, 32, 16):
        if b <= ql.group_size and ql.group_size % b == 0 and k % b == 0:
            return b
    raise ValueError(f"group size {ql.group_size} (K={k}) has no MatMulNBits block size: "
                     f"need a power of two in [{MIN_BLOCK}, {MAX_BLOCK}] dividing both")


def input_order(ql: QuantizedLinear) -> np.ndarray | None:
    """None for the identity ordering, else perm [K] int64 such that x[..., perm] @ W[perm]
    has each group's features contiguous and in group order (GPTQ desc_act)."""
    if not ql.act_order:
        return None
    k = ql.q.shape[1]
    perm = torch.argsort(ql.g_idx, stable=True)
    if not torch.equal(ql.g_idx[perm], torch.arange(k) // ql.group_size):
        counts = torch.bincount(ql.g_idx).tolist()
        raise ValueError(f"g_idx groups hold {sorted(set(counts))} features each; "
                         f"expected {ql.group_size} (the group size)")
    return perm.numpy().astype(np.int64)


def nbits_weights(ql: QuantizedLinear):
    """-> (packed [N, K/b, b/2] uint8, scales [N*K/b] fp32, zero_points [N*ceil(K/b/2)]
    uint8, b, perm [K] int64 or None): MatMulNBits' B, its fp32 scales (fp16 values, exact)
    and its integer zero points, over the input in `perm`'s order."""
    from trt_spec.export.quantize import _pack_int4

    n, k = ql.q.shape
    b = block_size(ql)
    perm = input_order(ql)
    order = torch.arange(k) if perm is None else torch.from_numpy(perm)
    g = ql.g_idx[order][::b]  # the group of each block: [K/b]
    q = ql.q[:, order].numpy().reshape(n, k // b, b)
    packed, scales, zps = _pack_int4(q, ql.scales.float()[:, g].numpy(), ql.zeros[:, g].numpy())
    return packed, scales, zps, b, perm


def in_group_order(graph, new_nodes, done: dict[tuple[str, bytes], str], x: str,
                   perm: np.ndarray | None) -> str:
    """x [.., K] -> x[..., perm] (once per input and order; x itself for None): the input
    order in which a desc_act checkpoint's groups are contiguous.

        x --Gather(perm, axis=-1)--> x_in_group_order
    """
    from onnx import helper, numpy_helper

    if perm is None:
        return x
    key = (x, perm.tobytes())
    if key not in done:
        name = f"{x}/act_order{len([k for k in done if k[0] == x]) or ''}"
        graph.initializer.append(numpy_helper.from_array(perm, name + ".perm"))
        new_nodes.append(helper.make_node("Gather", [x, name + ".perm"], [name], axis=-1,
                                          name=name + "/Gather"))
        done[key] = name
    return done[key]


def dequantize_nbits(packed, scales, zero_points, k: int, n: int, block: int,
                     perm: np.ndarray | None) -> np.ndarray:
    """The [K, N] weights a checkpoint's MatMulNBits computes with, rows back in the input's
    own order (the inverse of nbits_weights)."""
    from trt_spec.export.quantize import dequantize_int4

    w = dequantize_int4(packed, scales, zero_points, k, n, block)
    if perm is None:
        return w
    out = np.empty_like(w)
    out[perm] = w
    return out


def checkpoint_matmul(graph, new_nodes, ordered: dict, node, ql: QuantizedLinear,
                      shape: tuple[int, int], accuracy_level: int, errors: dict | None) -> None:
    """MatMul(x, W) whose W [K, N] is `ql`'s weights bitwise -> MatMulNBits with ql's codes,
    zero points and scales (appended to new_nodes, its initializers to graph), its input in
    group order (in_group_order, shared through `ordered`). `errors` as matmuls_to_nbits'."""
    from onnx import helper, numpy_helper

    k, n = shape
    w_name = node.input[1]
    packed, scales, zps, block, perm = nbits_weights(ql)
    if errors is not None:
        w = dequantize(ql).T.numpy()
        wq = dequantize_nbits(packed, scales, zps, k, n, block, perm)
        errors[w_name] = ("int4-checkpoint",
                          float(np.linalg.norm(wq - w) / max(np.linalg.norm(w), 1e-30)))
    prefix = f"{w_name}.int4-checkpoint"
    graph.initializer.extend([numpy_helper.from_array(packed, prefix + ".q"),
                              numpy_helper.from_array(scales, prefix + ".scales"),
                              numpy_helper.from_array(zps, prefix + ".zp")])
    new_nodes.append(helper.make_node(
        "MatMulNBits", [in_group_order(graph, new_nodes, ordered, node.input[0], perm),
                        prefix + ".q", prefix + ".scales", prefix + ".zp"],
        list(node.output), name=(node.name or w_name) + "/MatMulNBits", domain="com.microsoft",
        K=k, N=n, bits=4, block_size=block, accuracy_level=accuracy_level))
