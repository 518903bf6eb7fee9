"""Weight-only int4 for ONNX Runtime: MatMul(x, W) -> com.microsoft::MatMulNBits.

Blocks of 32 weights along K share a scale and a 4-bit zero point (asymmetric, range widened
to include 0): w ~ (q - zp) * scale, q in 0..15. For weights that came from a Q4_1 GGUF (a
16-level grid d*q + m per 32-block) this recovers the same grid with scale = d whenever the
block spans it; only the zero point is rounded (a shift of at most half a step).
accuracy_level=4 selects ORT's int8-compute kernels, the fast path on x86 (NOTES.md).
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper

BLOCK = 32


def quantize_int4(w: np.ndarray, block: int = BLOCK):
    """w: [K, N] fp32 (MatMul's B) -> (packed [N, K/block, block/2] uint8, scales [N*K/block]
    fp32, zero_points [N*ceil(K/block/2)] uint8) in MatMulNBits' layout."""
    k, n = w.shape
    assert k % block == 0, (k, block)
    blocks = k // block
    wt = w.T.reshape(n, blocks, block).astype(np.float32)  # (N, nb, block)
    lo = np.minimum(wt.min(-1), 0.0)
    hi = np.maximum(wt.max(-1), 0.0)
    scale = (hi - lo) / 15.0
    scale = np.where(scale == 0, 1.0, scale).astype(np.float32)  # (N, nb)
    zp = np.clip(np.round(-lo / scale), 0, 15).astype(np.uint8)
    q = np.clip(np.round(wt / scale[..., None]) + zp[..., None], 0, 15).astype(np.uint8)
    packed = (q[..., 0::2] | (q[..., 1::2] << 4)).astype(np.uint8)  # low nibble first
    if blocks % 2:
        zp = np.concatenate([zp, np.zeros((n, 1), np.uint8)], axis=1)
    zp_packed = (zp[:, 0::2] | (zp[:, 1::2] << 4)).astype(np.uint8)
    return packed, scale.reshape(-1), zp_packed.reshape(-1)


def dequantize_int4(packed, scales, zero_points, k: int, n: int, block: int = BLOCK) -> np.ndarray:
    """Inverse of quantize_int4 (the weights MatMulNBits computes with): [K, N] fp32."""
    blocks = k // block
    q = np.empty((n, blocks, block), np.uint8)
    q[..., 0::2], q[..., 1::2] = packed & 0xF, packed >> 4
    zp = np.empty((n, (blocks + 1) // 2 * 2), np.uint8)
    zpp = zero_points.reshape(n, -1)
    zp[:, 0::2], zp[:, 1::2] = zpp & 0xF, zpp >> 4
    w = (q.astype(np.float32) - zp[:, :blocks, None]) * scales.reshape(n, blocks)[..., None]
    return w.reshape(n, k).T


def matmuls_to_nbits(model: onnx.ModelProto, accuracy_level: int = 4,
                     min_elements: int = 4096) -> int:
    """Replaces every MatMul whose B is a 2-D initializer with K % 32 == 0 (and at least
    `min_elements` weights) by MatMulNBits, in place. Returns how many were replaced."""
    graph = model.graph
    inits = {i.name: i for i in graph.initializer}
    uses: dict[str, int] = {}
    for node in graph.node:
        for name in node.input:
            uses[name] = uses.get(name, 0) + 1
    replaced = 0
    new_nodes = []
    for node in graph.node:
        w_name = node.input[1] if node.op_type == "MatMul" and len(node.input) == 2 else None
        init = inits.get(w_name) if w_name else None
        if init is None or len(init.dims) != 2 or init.dims[0] % BLOCK or \
                init.dims[0] * init.dims[1] < min_elements:
            new_nodes.append(node)
            continue
        w = numpy_helper.to_array(init)
        k, n = w.shape
        packed, scales, zps = quantize_int4(w)
        prefix = f"{w_name}.int4"
        graph.initializer.extend([
            numpy_helper.from_array(packed, prefix + ".q"),
            numpy_helper.from_array(scales, prefix + ".scales"),
            numpy_helper.from_array(zps, prefix + ".zp"),
        ])
        new_nodes.append(helper.make_node(
            "MatMulNBits", [node.input[0], prefix + ".q", prefix + ".scales", prefix + ".zp"],
            list(node.output), name=(node.name or w_name) + "/MatMulNBits", domain="com.microsoft",
            K=k, N=n, bits=4, block_size=BLOCK, accuracy_level=accuracy_level))
        uses[w_name] -= 1
        replaced += 1
    del graph.node[:]
    graph.node.extend(new_nodes)
    dead = [i for i in graph.initializer if uses.get(i.name, 1) == 0]
    for i in dead:
        graph.initializer.remove(i)
    if not any(o.domain == "com.microsoft" for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    return replaced
