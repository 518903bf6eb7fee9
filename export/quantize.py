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


def quantize_int8(w: np.ndarray, block: int = BLOCK):
    """w: [K, N] fp32 -> (q [N, K/block, block] uint8, scales [N*K/block], zero_points
    [N*K/block] uint8 = 128). Symmetric, scale = max|w| / 127: exact for weights that came
    from a Q8_0 GGUF tensor (w = d*q, |q| <= 127, d = amax / 127)."""
    k, n = w.shape
    assert k % block == 0, (k, block)
    wt = w.T.reshape(n, k // block, block).astype(np.float32)  # (N, nb, block)
    scale = np.abs(wt).max(-1) / 127.0
    scale = np.where(scale == 0, 1.0, scale).astype(np.float32)
    q = (np.clip(np.round(wt / scale[..., None]), -127, 127) + 128).astype(np.uint8)
    return q, scale.reshape(-1), np.full(scale.size, 128, np.uint8)


def dequantize_int8(q, scales, zero_points, k: int, n: int, block: int = BLOCK) -> np.ndarray:
    blocks = k // block
    w = (q.astype(np.float32) - zero_points.reshape(n, blocks, 1)) * scales.reshape(n, blocks, 1)
    return w.reshape(n, k).T


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


QUANTIZERS = {4: quantize_int4, 8: quantize_int8}


def matmuls_to_nbits(model: onnx.ModelProto, bits_for, accuracy_level: int = 4,
                     min_elements: int = 4096) -> int:
    """Replaces every MatMul whose B is a 2-D initializer with K % 32 == 0 (and at least
    `min_elements` weights) by MatMulNBits, in place. `bits_for(output_name, shape)` (the MatMul's output) picks
    4 or 8 bits (or None to keep fp32). Returns how many were replaced."""
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
        bits = bits_for(node.output[0], (k, n))
        if bits is None:
            new_nodes.append(node)
            continue
        packed, scales, zps = QUANTIZERS[bits](w)
        prefix = f"{w_name}.int{bits}"
        graph.initializer.extend([
            numpy_helper.from_array(packed, prefix + ".q"),
            numpy_helper.from_array(scales, prefix + ".scales"),
            numpy_helper.from_array(zps, prefix + ".zp"),
        ])
        new_nodes.append(helper.make_node(
            "MatMulNBits", [node.input[0], prefix + ".q", prefix + ".scales", prefix + ".zp"],
            list(node.output), name=(node.name or w_name) + "/MatMulNBits", domain="com.microsoft",
            K=k, N=n, bits=bits, block_size=BLOCK, accuracy_level=accuracy_level))
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


def tie_embedding_int8(model: onnx.ModelProto, accuracy_level: int = 4) -> dict[str, str] | None:
    """Makes the tied embedding and lm_head share one int8 copy of the table.

        ids --Gather(E)-->            becomes   ids --GatherBlockQuantized(Eq, s, zp)-->
        h --MatMul(Transpose(E))-->             h --MatMulNBits(Eq, s, zp, bits=8)--> logits

    Eq is quantize_int8(E.T): [vocab, H/32, 32] rows of E in 32-blocks, which is both
    MatMulNBits' B layout and (viewed as [vocab, H]) the gather table. The two views are
    separate initializers; the returned aliases {view: source} let the saver point both at
    the same bytes on disk. Returns None when the graph has no tied head."""
    graph = model.graph
    producers = {o: n for n in graph.node for o in n.output}
    head = producers.get("logits")
    if head is None or head.op_type != "MatMul":
        return None
    transpose = producers.get(head.input[1])
    if transpose is None or transpose.op_type != "Transpose":
        return None
    table = transpose.input[0]
    gathers = [n for n in graph.node if n.op_type == "Gather" and n.input[0] == table]
    inits = {i.name: i for i in graph.initializer}
    if len(gathers) != 1 or table not in inits:
        return None
    e = numpy_helper.to_array(inits[table])  # (vocab, H)
    vocab, hidden = e.shape
    q, scales, zps = quantize_int8(e.T)  # q: (vocab, H/32, 32)
    p = f"{table}.int8"
    graph.initializer.extend([
        numpy_helper.from_array(q, p + ".q"),
        numpy_helper.from_array(scales, p + ".scales"),
        numpy_helper.from_array(zps, p + ".zp"),
        numpy_helper.from_array(q.reshape(vocab, hidden), p + ".rows"),
        numpy_helper.from_array(scales.reshape(vocab, -1), p + ".rows.scales"),
        numpy_helper.from_array(zps.reshape(vocab, -1), p + ".rows.zp"),
    ])
    gather = gathers[0]
    nodes = []
    for node in graph.node:
        if node is transpose:
            continue
        if node is head:
            node = helper.make_node(
                "MatMulNBits", [head.input[0], p + ".q", p + ".scales", p + ".zp"], ["logits"],
                name="/lm_head/MatMulNBits", domain="com.microsoft", K=hidden, N=vocab, bits=8,
                block_size=BLOCK, accuracy_level=accuracy_level)
        elif node is gather:
            node = helper.make_node(
                "GatherBlockQuantized", [p + ".rows", gather.input[1], p + ".rows.scales",
                                         p + ".rows.zp"], list(gather.output),
                name="/embed_tokens/GatherBlockQuantized", domain="com.microsoft", bits=8,
                block_size=BLOCK, quantize_axis=1, gather_axis=0)
        nodes.append(node)
    del graph.node[:]
    graph.node.extend(nodes)
    graph.initializer.remove(inits[table])
    return {p + ".rows": p + ".q", p + ".rows.scales": p + ".scales", p + ".rows.zp": p + ".zp"}


def embedding_int8(model: onnx.ModelProto, min_rows: int = 1024) -> int:
    """An embedding table read only by a Gather (a drafter's copy of the target's, untied from
    any head) -> one int8 GatherBlockQuantized, as the tied case's gather half. Returns how
    many tables were replaced."""
    graph = model.graph
    inits = {i.name: i for i in graph.initializer}
    readers: dict[str, list] = {}
    for node in graph.node:
        for name in node.input:
            readers.setdefault(name, []).append(node)
    replaced = 0
    for table, nodes in readers.items():
        init = inits.get(table)
        if (init is None or len(init.dims) != 2 or init.dims[0] < min_rows
                or init.dims[1] % BLOCK or len(nodes) != 1 or nodes[0].op_type != "Gather"
                or nodes[0].input[0] != table):
            continue
        gather = nodes[0]
        e = numpy_helper.to_array(init)  # (vocab, H)
        vocab, hidden = e.shape
        q, scales, zps = quantize_int8(e.T)  # rows of E in 32-blocks
        p = f"{table}.int8.rows"
        graph.initializer.extend([
            numpy_helper.from_array(q.reshape(vocab, hidden), p),
            numpy_helper.from_array(scales.reshape(vocab, -1), p + ".scales"),
            numpy_helper.from_array(zps.reshape(vocab, -1), p + ".zp"),
        ])
        new = helper.make_node(
            "GatherBlockQuantized", [p, gather.input[1], p + ".scales", p + ".zp"],
            list(gather.output), name=(gather.name or table) + "/GatherBlockQuantized",
            domain="com.microsoft", bits=8, block_size=BLOCK, quantize_axis=1, gather_axis=0)
        index = list(graph.node).index(gather)
        graph.node.remove(gather)
        graph.node.insert(index, new)
        graph.initializer.remove(init)
        replaced += 1
    if replaced and not any(o.domain == "com.microsoft" for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    return replaced
