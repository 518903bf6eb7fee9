"""Weight-only quantization for ONNX Runtime: MatMul(x, W) -> com.microsoft::MatMulNBits.

Blocks of 32 weights along K share a scale and a zero point: w ~ (q - zp) * scale. The
forms (FORMS), each a function quantize_<form> below:
- "int8": symmetric 8-bit blocks (exact for a Q8_0 GGUF tensor).
- "int4": 4-bit blocks, range widened to include 0, integer zero point. For weights that came
  from a Q4_1 GGUF (w = d*q + m per 32-block) the zero point -m/d is rounded: every weight of
  the block moves by up to half a step (8-9% relative error per matrix on SmolLM2).
- "int4+residual": the same 4-bit blocks plus the per-block residual that the integer zero
  point leaves, applied to the input's block sums in the same kernel (quantize_int4_residual):
  a Q4_1 GGUF's weights, at ~4% more bytes.
accuracy_level=4 selects ORT's int8-compute kernels, the fast path on x86 (docs/quantization.md); ORT's
float zero points (exact for Q4_1 by themselves) run ~35x slower.

- "int4-checkpoint": a GPTQ / AWQ checkpoint's own codes, integer zero points and scales,
  unchanged (block size = its group size; matmuls_to_nbits' `given`, export/int4_checkpoint.py):
  the weights it stands for, bitwise, on the same fast int4 kernels.
Two forms are not MatMulNBits:
- "int8-rows": int8 weights, one scale per output column, and the input quantized to int8 at
  run time, one scale per row (export/int8_rows.py), multiplied by MatMulIntegerToFloat:
  ONNX Runtime runs that on its integer GEMM (AMX / VNNI tiles), whose cost barely grows
  with the rows a step verifies, where MatMulNBits' grows ~80% a row. Each row is quantized on its own, so a
  token's result does not depend on the rows beside it.
- "int8-rows2": the same weights, the input read in two 8-bit passes (the second quantizes what
  the first left out): ~15 bits of the row for one more integer GEMM. "int8-rows" takes it
  where fidelity needs it most (measured, docs/quantization.md): the down projection (the
  MatMul that narrows, K > N) and q/k/v (the MatMul GroupQueryAttention reads).
The int8-rows precision smooths the target first (export/smooth.py).
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper

from trt_spec.export.int8_rows import (dequantize_int8_columns, int8_rows_matmul,
                                      quantize_int8_columns, rows_int8, rows_int8_error)
from trt_spec.export.spill import tensor_array

BLOCK = 32


CHUNK_ELEMENTS = 1 << 24  # a quantizer's float32 temporaries: 64 MB at a time


def by_columns(quantize, w: np.ndarray, block: int):
    """quantize(w[:, j0:j1]) over chunks of CHUNK_ELEMENTS weights, concatenated: each output
    column's blocks are quantized on their own, so the result is the same as one call's, with
    temporaries the size of a chunk instead of the matrix (a 150k x 896 embedding: 0.5 GB
    each). Returns None when w is one chunk already."""
    k, n = w.shape
    columns = max(1, CHUNK_ELEMENTS // k)
    if n <= columns:
        return None
    parts = [quantize(w[:, j:j + columns], block) for j in range(0, n, columns)]
    return tuple(np.concatenate(p) for p in zip(*parts))


def quantize_int8(w: np.ndarray, block: int = BLOCK):
    """w: [K, N] fp32 -> (q [N, K/block, block] uint8, scales [N*K/block], zero_points
    [N*K/block] uint8 = 128). Symmetric, scale = max|w| / 127: exact for weights that came
    from a Q8_0 GGUF tensor (w = d*q, |q| <= 127, d = amax / 127)."""
    k, n = w.shape
    assert k % block == 0, (k, block)
    if (chunked := by_columns(quantize_int8, w, block)) is not None:
        return chunked
    wt = w.T.reshape(n, k // block, block).astype(np.float32)  # (N, nb, block), a copy
    scale = np.maximum(wt.max(-1), -wt.min(-1)) / 127.0  # max |w|, without an |w| copy
    scale = np.where(scale == 0, 1.0, scale).astype(np.float32)
    # in place, in wt: the same float32 steps as round(w / scale) clipped, + 128, with no
    # temporary the size of the matrix (an embedding table's is 0.5 GB at 150k x 896)
    np.divide(wt, scale[..., None], out=wt)
    np.round(wt, out=wt)
    np.clip(wt, -127, 127, out=wt)
    wt += 128
    return wt.astype(np.uint8), scale.reshape(-1), np.full(scale.size, 128, np.uint8)


def dequantize_int8(q, scales, zero_points, k: int, n: int, block: int = BLOCK) -> np.ndarray:
    blocks = k // block
    w = (q.astype(np.float32) - zero_points.reshape(n, blocks, 1)) * scales.reshape(n, blocks, 1)
    return w.reshape(n, k).T


def _int4_blocks(wt: np.ndarray):
    """wt [N, nb, block] -> unpacked (q [N, nb, block] uint8, scale [N, nb] fp32, zp [N, nb]
    uint8): asymmetric 4-bit blocks, range widened to include 0, integer zero point."""
    lo = np.minimum(wt.min(-1), 0.0)
    hi = np.maximum(wt.max(-1), 0.0)
    scale = (hi - lo) / 15.0
    scale = np.where(scale == 0, 1.0, scale).astype(np.float32)
    zp = np.clip(np.round(-lo / scale), 0, 15).astype(np.uint8)
    # round(wt / scale) + zp clipped to 0..15, in one temporary (wt is the caller's)
    q = wt / scale[..., None]
    np.round(q, out=q)
    q += zp[..., None]
    np.clip(q, 0, 15, out=q)
    return q.astype(np.uint8), scale, zp


def _pack_int4(q: np.ndarray, scale: np.ndarray, zp: np.ndarray):
    """Unpacked q [N, nb, block], scale / zp [N, nb] -> MatMulNBits' (packed [N, nb, block/2]
    uint8, scales [N*nb] fp32, zero_points [N*ceil(nb/2)] uint8), low nibble first."""
    n, blocks = scale.shape
    packed = (q[..., 0::2] | (q[..., 1::2] << 4)).astype(np.uint8)
    if blocks % 2:
        zp = np.concatenate([zp, np.zeros((n, 1), np.uint8)], axis=1)
    zp_packed = (zp[:, 0::2] | (zp[:, 1::2] << 4)).astype(np.uint8)
    return packed, scale.reshape(-1).astype(np.float32), zp_packed.reshape(-1)


def _unpack_int4(packed, scales, zero_points, n: int, blocks: int, block: int = BLOCK):
    """Inverse of _pack_int4 -> (q - zp) * scale [N, blocks, block] fp32."""
    q = np.empty((n, blocks, block), np.uint8)
    q[..., 0::2], q[..., 1::2] = packed & 0xF, packed >> 4
    zp = np.empty((n, (blocks + 1) // 2 * 2), np.uint8)
    zpp = zero_points.reshape(n, -1)
    zp[:, 0::2], zp[:, 1::2] = zpp & 0xF, zpp >> 4
    return (q.astype(np.float32) - zp[:, :blocks, None]) * scales.reshape(n, blocks)[..., None]


def quantize_int4(w: np.ndarray, block: int = BLOCK):
    """w: [K, N] fp32 (MatMul's B) -> (packed [N, K/block, block/2] uint8, scales [N*K/block]
    fp32, zero_points [N*ceil(K/block/2)] uint8) in MatMulNBits' layout."""
    k, n = w.shape
    assert k % block == 0, (k, block)
    if (chunked := by_columns(quantize_int4, w, block)) is not None:
        return chunked
    return _pack_int4(*_int4_blocks(w.T.reshape(n, k // block, block).astype(np.float32)))


def dequantize_int4(packed, scales, zero_points, k: int, n: int, block: int = BLOCK) -> np.ndarray:
    """Inverse of quantize_int4 (the weights MatMulNBits computes with): [K, N] fp32."""
    return _unpack_int4(packed, scales, zero_points, n, k // block, block).reshape(n, k).T


# int4 stages that carry the residual: each cuts what is left ~15x. Measured on SmolLM2's
# Q4_1 weights (docs/quantization.md): one stage 0.5% relative weight error, held-out KL 0.0037,
# 107.8 MB; two 0.03%, KL 0.0028, 111 MB, and ~2% slower decoding.
RESIDUAL_STAGES = 1


def sums_width(k: int, block: int = BLOCK) -> int:
    """Columns of the block sums appended to an input of K features: K/block rounded up to
    whole blocks."""
    return -(-(k // block) // block) * block


def quantize_int4_residual(w: np.ndarray, block: int = BLOCK):
    """w: [K, N] fp32 -> MatMulNBits weights (packed, scales, zero_points) over the augmented
    input [x, sums, ...] of K + RESIDUAL_STAGES*P features, P = sums_width(K): GGUF's Q4_1
    form (per 32-block w ~ d*q + min, q in 0..15, the minimum kept) in a kernel whose zero
    point is an integer. The block is split as

        w = d * (q - zp) + r,   zp = round(-min / d) in 0..15,  r = min + d * zp

    MatMulNBits computes the first term. The residual r (one value per block, at most half a
    step when the block spans 0) is what the plain int4 form drops: every weight of the block
    shifted by up to half a step. r multiplies the input's block sums, so it rides in the same
    kernel on extra input columns:

        x @ W = MatMulNBits([x, sums(x)]; [q-blocks; r])

    Each stage is what the earlier ones left of r, as int4 blocks along the block-sum axis
    (RESIDUAL_STAGES). For weights dequantized from a Q4_1 GGUF (min = m, (max - min)/15 = d)
    this reproduces them up to the last stage's rounding (1/30 of r's range per row); for any
    other weights it is min/max round-to-nearest."""
    k, n = w.shape
    assert k % block == 0, (k, block)
    blocks, width = k // block, sums_width(k, block)
    wt = w.T.reshape(n, blocks, block).astype(np.float32)  # (N, nb, block)
    lo = wt.min(-1)
    d = (wt.max(-1) - lo) / 15.0
    d = np.where(d == 0, 1.0, d).astype(np.float32)  # (N, nb)
    q = np.clip(np.round((wt - lo[..., None]) / d[..., None]), 0, 15).astype(np.uint8)
    zp = np.clip(np.round(-lo / d), 0, 15).astype(np.uint8)
    rest = np.zeros((n, width), np.float32)  # r, padded to whole blocks
    rest[:, :blocks] = lo.astype(np.float64) + d.astype(np.float64) * zp
    qs, scales, zps = [q], [d], [zp]
    for _ in range(RESIDUAL_STAGES):
        rq, rs, rz = _int4_blocks(rest.reshape(n, width // block, block))
        rest = rest - ((rq.astype(np.float32) - rz[..., None]) * rs[..., None]).reshape(n, width)
        qs.append(rq), scales.append(rs), zps.append(rz)
    return _pack_int4(np.concatenate(qs, 1), np.concatenate(scales, 1), np.concatenate(zps, 1))


def dequantize_int4_residual(packed, scales, zero_points, k: int, n: int,
                             block: int = BLOCK) -> np.ndarray:
    """The [K, N] weights quantize_int4_residual's MatMulNBits computes with (for x, whose
    block sums it appends)."""
    blocks, width = k // block, sums_width(k, block)
    w = _unpack_int4(packed, scales, zero_points, n, blocks + RESIDUAL_STAGES * width // block,
                     block).reshape(n, -1)
    r = sum(w[:, k + i * width:k + i * width + blocks] for i in range(RESIDUAL_STAGES))
    return (w[:, :k] + np.repeat(r, block, axis=1)).T


QUANTIZERS = {"int8": quantize_int8, "int4": quantize_int4,
              "int4+residual": quantize_int4_residual, "int8-rows": quantize_int8_columns,
              "int8-rows2": quantize_int8_columns}
FORMS = tuple(QUANTIZERS)


def _with_block_sums(graph, new_nodes, done: dict[str, str], x: str, k: int) -> str:
    """x [.., K] -> [x, sums (once per residual stage)] [.., K + stages*P], once per input
    tensor: sums [.., P] holds x's sum over each 32-block (zero-padded to P = sums_width(K)).

        x --MatMul(ones_blocks [K, P])--> sums --+
        x ------------------------------------Concat(x, sums, ...)--> x_with_sums
    """
    if x not in done:
        width = sums_width(k)
        ones = f"block_ones.{k}"
        if not any(i.name == ones for i in graph.initializer):
            indicator = np.zeros((k, width), np.float32)
            indicator[np.arange(k), np.arange(k) // BLOCK] = 1.0
            graph.initializer.append(numpy_helper.from_array(indicator, ones))
        sums = f"{x}/block_sums"
        done[x] = f"{x}/with_block_sums"
        new_nodes.append(helper.make_node("MatMul", [x, ones], [sums], name=f"{sums}/MatMul"))
        new_nodes.append(helper.make_node("Concat", [x] + [sums] * RESIDUAL_STAGES, [done[x]],
                                          axis=-1, name=f"{done[x]}/Concat"))
    return done[x]


DEQUANTIZERS = {"int8": dequantize_int8, "int4": dequantize_int4,
                "int4+residual": dequantize_int4_residual, "int8-rows": dequantize_int8_columns,
                "int8-rows2": dequantize_int8_columns}
def matmuls_to_nbits(model: onnx.ModelProto, form_for, accuracy_level: int = 4,
                     min_elements: int = 4096, errors: dict | None = None,
                     given: dict | None = None) -> int:
    """Replaces every MatMul whose B is a 2-D initializer with K % 32 == 0 (and at least
    `min_elements` weights) by MatMulNBits, in place. `form_for(output_name, shape)` (the
    MatMul's output) picks one of FORMS (or None to keep fp32). Returns how many were
    replaced. "int4+residual" MatMuls read their input with its block sums appended
    (_with_block_sums, shared by every weight that reads the same input). `errors`, if given,
    receives {weight name: (form, |W_q - W|_F / |W|_F)}: what each replacement computes
    against the weights it was given.

    `given` ({int4_checkpoint.content_key: QuantizedLinear}, a GPTQ / AWQ checkpoint's codes):
    a MatMul whose weight is one of them (bitwise) gets those codes, zero points and scales
    unchanged, form "int4-checkpoint", whatever `form_for` says; its input is gathered into
    the checkpoint's group order where g_idx is not the identity. Every given weight must be
    found (ValueError otherwise: nothing is quantized again silently)."""
    from trt_spec.export.int4_checkpoint import checkpoint_matmul, content_key
    graph = model.graph
    inits = {i.name: i for i in graph.initializer}
    uses: dict[str, int] = {}
    for node in graph.node:
        for name in node.input:
            uses[name] = uses.get(name, 0) + 1
    readers: dict[str, set[str]] = {}
    for node in graph.node:
        for name in node.input:
            readers.setdefault(name, set()).add(node.op_type)
    replaced = 0
    new_nodes = []
    augmented: dict[str, str] = {}
    rows: dict[str, tuple[str, str]] = {}
    ordered: dict[tuple[str, bytes], str] = {}
    found: set[str] = set()
    for node in graph.node:
        w_name = node.input[1] if node.op_type == "MatMul" and len(node.input) == 2 else None
        init = inits.get(w_name) if w_name else None
        if init is None or len(init.dims) != 2 or init.dims[0] % BLOCK or \
                init.dims[0] * init.dims[1] < min_elements:
            new_nodes.append(node)
            continue
        w = tensor_array(init)
        k, n = w.shape
        key = content_key(w) if given else None
        if given and key in given:
            found.add(key)
            checkpoint_matmul(graph, new_nodes, ordered, node, given[key], (k, n),
                              accuracy_level, errors)
            uses[w_name] -= 1
            replaced += 1
            continue
        form = form_for(node.output[0], (k, n))
        if form == "int8-rows" and (k > n or "GroupQueryAttention"
                                    in readers.get(node.output[0], ())):
            form = "int8-rows2"  # the down projection and qkv: the inputs fidelity needs most
        if form is None:
            new_nodes.append(node)
            continue
        assert form in FORMS, form
        packed, scales, zps = QUANTIZERS[form](w)
        if errors is not None:
            wq = DEQUANTIZERS[form](packed, scales, zps, k, n)
            errors[w_name] = (form, float(np.linalg.norm(wq - w) / max(np.linalg.norm(w), 1e-30)))
        x = node.input[0]
        prefix = f"{w_name}.{form}"
        if form in ("int8-rows", "int8-rows2"):
            graph.initializer.extend([numpy_helper.from_array(packed, prefix + ".q"),
                                      numpy_helper.from_array(scales, prefix + ".scales")])
            passes = [rows_int8(graph, new_nodes, rows, x, k)]
            if form == "int8-rows2":
                passes.append(rows_int8(graph, new_nodes, rows,
                                         rows_int8_error(new_nodes, x, passes[0], k), k))
            int8_rows_matmul(new_nodes, passes, prefix, node.output[0], node.name or w_name)
            uses[w_name] -= 1
            replaced += 1
            continue
        if form == "int4+residual":
            x = _with_block_sums(graph, new_nodes, augmented, x, k)
            k += RESIDUAL_STAGES * sums_width(k)
        graph.initializer.extend([
            numpy_helper.from_array(packed, prefix + ".q"),
            numpy_helper.from_array(scales, prefix + ".scales"),
            numpy_helper.from_array(zps, prefix + ".zp"),
        ])
        new_nodes.append(helper.make_node(
            "MatMulNBits", [x, prefix + ".q", prefix + ".scales", prefix + ".zp"],
            list(node.output), name=(node.name or w_name) + "/MatMulNBits", domain="com.microsoft",
            K=k, N=n, bits=8 if form == "int8" else 4, block_size=BLOCK,
            accuracy_level=accuracy_level))
        uses[w_name] -= 1
        replaced += 1
    if given and len(found) != len(given):
        raise ValueError(f"{len(given) - len(found)} of the checkpoint's {len(given)} quantized "
                         "weights are not MatMul weights of this graph (bitwise): not exported")
    del graph.node[:]
    graph.node.extend(new_nodes)
    dead = [i for i in graph.initializer if uses.get(i.name, 1) == 0]
    for i in dead:
        graph.initializer.remove(i)
    if not any(o.domain == "com.microsoft" for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    if rows:  # QuantizeLinear's blocks (one per row) need opset 21; 20 -> 21 adds types only
        for o in model.opset_import:
            if o.domain in ("", "ai.onnx") and o.version < 21:
                o.version = 21
    return replaced


def tie_embedding_int8(model: onnx.ModelProto, accuracy_level: int = 4,
                       rescore_top: int = 0) -> dict[str, str] | None:
    """Makes the tied embedding and lm_head share one int8 copy of the table.

        ids --Gather(E)-->            becomes   ids --GatherBlockQuantized(Eq, s, zp)-->
        h --MatMul(Transpose(E))-->             h --MatMulNBits(Eq, s, zp, bits=8)--> logits

    Eq is quantize_int8(E.T): [vocab, H/32, 32] rows of E in 32-blocks, which is both
    MatMulNBits' B layout and (viewed as [vocab, H]) the gather table. The two views are
    separate initializers; the returned aliases {view: source} let the saver point both at
    the same bytes on disk. Returns None when the graph has no tied head.

    rescore_top > 0: the head reads a 4-bit copy of the table instead, and its `rescore_top`
    highest logits of each row are computed again from the int8 rows (rescored_head): half
    the bytes a step reads for the head, and the same top tokens."""
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
    e = tensor_array(inits[table])  # (vocab, H)
    vocab, hidden = e.shape
    q, scales, zps = quantize_int8(e.T)  # q: (vocab, H/32, 32)
    p = f"{table}.int8"
    if not rescore_top:
        graph.initializer.extend([
            numpy_helper.from_array(q, p + ".q"),
            numpy_helper.from_array(scales, p + ".scales"),
            numpy_helper.from_array(zps, p + ".zp"),
        ])
    graph.initializer.extend([
        numpy_helper.from_array(q.reshape(vocab, hidden), p + ".rows"),
        numpy_helper.from_array(scales.reshape(vocab, -1), p + ".rows.scales"),
        numpy_helper.from_array(zps.reshape(vocab, -1), p + ".rows.zp"),
    ])
    gather = gathers[0]
    nodes = []
    for node in graph.node:
        if node is transpose:
            continue
        if node is head and rescore_top:
            nodes.extend(rescored_head(graph, head.input[0], e, p + ".rows", rescore_top,
                                       accuracy_level))
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
    if rescore_top:
        return {}  # one view of the int8 table: nothing to alias
    return {p + ".rows": p + ".q", p + ".rows.scales": p + ".scales", p + ".rows.zp": p + ".zp"}


def rescored_head(graph, h: str, table: np.ndarray, rows: str, top: int,
                  accuracy_level: int = 4) -> list:
    """The head's nodes: logits from a 4-bit copy of `table` ([vocab, H]), with each row's
    `top` highest computed again, in fp32, from the int8 rows (`rows`, `rows`.scales,
    `rows`.zp: the GatherBlockQuantized table the embedding reads):

        h --MatMulNBits(4-bit table)--> approx --TopK(top)--> ids
        ids --GatherBlockQuantized(int8 rows)--> [.., top, H] --MatMul(h)--> exact
        ScatterElements(approx, ids, exact) --> logits

    The head is memory-bound: the 4-bit copy halves the bytes it reads a step. The top tokens
    (what greedy decoding and the verifier's argmax read, and nearly all of the sampled
    mass) get the int8 head's values, the rest the 4-bit values; `top` only has to hold the
    int8 head's best token, which sits among the 4-bit copy's few best."""
    vocab, hidden = table.shape
    top = min(top, vocab)
    packed, scales, zps = quantize_int4(table.T)
    p = f"{rows}.int4"
    graph.initializer.extend([
        numpy_helper.from_array(packed, p + ".q"),
        numpy_helper.from_array(scales, p + ".scales"),
        numpy_helper.from_array(zps, p + ".zp"),
        numpy_helper.from_array(np.array([top], np.int64), "/lm_head/top"),
        numpy_helper.from_array(np.array([-1], np.int64), "/lm_head/last_axis"),
    ])
    return [
        helper.make_node("MatMulNBits", [h, p + ".q", p + ".scales", p + ".zp"],
                         ["/lm_head/approx"], name="/lm_head/approx/MatMulNBits",
                         domain="com.microsoft", K=hidden, N=vocab, bits=4, block_size=BLOCK,
                         accuracy_level=accuracy_level),
        helper.make_node("TopK", ["/lm_head/approx", "/lm_head/top"],
                         ["/lm_head/top_values", "/lm_head/top_ids"], axis=-1,
                         name="/lm_head/TopK"),
        helper.make_node("GatherBlockQuantized", [rows, "/lm_head/top_ids", rows + ".scales",
                                                  rows + ".zp"], ["/lm_head/top_rows"],
                         name="/lm_head/top_rows/GatherBlockQuantized", domain="com.microsoft",
                         bits=8, block_size=BLOCK, quantize_axis=1, gather_axis=0),
        helper.make_node("Unsqueeze", [h, "/lm_head/last_axis"], ["/lm_head/h_column"],
                         name="/lm_head/h_column/Unsqueeze"),
        helper.make_node("MatMul", ["/lm_head/top_rows", "/lm_head/h_column"],
                         ["/lm_head/top_logits_column"], name="/lm_head/rescore/MatMul"),
        helper.make_node("Squeeze", ["/lm_head/top_logits_column", "/lm_head/last_axis"],
                         ["/lm_head/top_logits"], name="/lm_head/rescore/Squeeze"),
        helper.make_node("ScatterElements", ["/lm_head/approx", "/lm_head/top_ids",
                                             "/lm_head/top_logits"], ["logits"], axis=-1,
                         name="/lm_head/ScatterElements"),
    ]


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
        e = tensor_array(init)  # (vocab, H)
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
