"""The lean int4 graph: no node onnxruntime-genai's graph does without, unless exactness needs it.

Weights with integer zero points (`--precision int4-plain`, a GPTQ / AWQ checkpoint's codes)
need no block-sum residual, so their graph can be as lean as onnxruntime-genai's builder
makes it. What is left beside theirs after quantization (export/quantize.py) is the fused
gate/up projection: the target traces `gate_up_proj` as one MatMul whose output a Split cuts in
two (export/model.py DecoderLayer.mlp). ORT's profiler, on this CPU and SmolLM2's shapes
(docs/quantization.md, "The lean graph"), puts the Split above what a second MatMulNBits
costs, so the lean graph runs gate and up as two products over the same input:

    x --MatMulNBits(N = 2I)--> gate_up --Split--> gate, up
becomes
    x --MatMulNBits(gate rows, N = I)--> gate
    x --MatMulNBits(up rows,   N = I)--> up

Every initializer of MatMulNBits whose first axis is per output column (the packed codes, the
scales, the zero points, a bias) is cut along N; g_idx (per input feature) is shared. The codes
are the same bytes, so the products are bitwise the same as the fused one's columns.

Attention's minimum rows (export/attention_rows.py) are not touched here: the exactness probe
asks for them on some CPUs (runtime/backends/exact_rows.py), and the pipeline adds them after.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper

from trt_spec.export.spill import tensor_array

# MatMulNBits' inputs: A, B, scales, zero_points, g_idx, bias. Those with one row per output
# column (N), cut when the product is cut; g_idx is per input feature.
PER_COLUMN = {1: "q", 2: "scales", 3: "zp", 5: "bias"}


def split_sizes(split: onnx.NodeProto, inits: dict, n: int) -> list[int] | None:
    """The sizes a Split cuts the last axis of an [.., N] tensor into, or None when it is not a
    cut of that axis this pass can read (sizes given as a constant input, or num_outputs
    dividing N)."""
    attrs = {a.name: helper.get_attribute_value(a) for a in split.attribute}
    if attrs.get("axis", 0) not in (-1, 2):
        return None
    if len(split.input) > 1 and split.input[1]:
        init = inits.get(split.input[1])
        return None if init is None else [int(s) for s in numpy_helper.to_array(init)]
    parts = attrs.get("num_outputs", len(split.output))
    return [n // parts] * parts if n % parts == 0 else None


def cut_columns(array: np.ndarray, n: int, lo: int, hi: int) -> np.ndarray:
    """Columns lo:hi of an initializer laid out with N rows first (any trailing shape, or a flat
    [N * x] vector) -> the same layout for hi - lo columns."""
    assert array.size % n == 0, (array.shape, n)
    rows = array.reshape(n, -1)[lo:hi]
    shape = (hi - lo, *array.shape[1:]) if array.ndim > 1 else (-1,)
    return np.ascontiguousarray(rows).reshape(shape)


def unfuse_split_products(model: onnx.ModelProto) -> int:
    """In place: every MatMulNBits read only by a Split of its last axis becomes one
    MatMulNBits per piece (module docstring). Returns how many Splits were removed."""
    graph = model.graph
    inits = {i.name: i for i in graph.initializer}
    readers: dict[str, list[onnx.NodeProto]] = {}
    for node in graph.node:
        for name in node.input:
            readers.setdefault(name, []).append(node)
    outputs = {o.name for o in graph.output}
    replace: dict[int, list[onnx.NodeProto]] = {}  # id(node) -> nodes in its place
    drop: set[int] = set()
    for node in graph.node:
        if node.op_type != "MatMulNBits" or node.domain != "com.microsoft":
            continue
        out = node.output[0]
        split = readers.get(out, [])
        if len(split) != 1 or split[0].op_type != "Split" or out in outputs:
            continue
        split = split[0]
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        n = attrs["N"]
        sizes = split_sizes(split, inits, n)
        if sizes is None or sum(sizes) != n or any(
                i < len(node.input) and node.input[i] and node.input[i] not in inits
                for i in PER_COLUMN):
            continue
        pieces, lo = [], 0
        for piece, (size, piece_out) in enumerate(zip(sizes, split.output)):
            inputs = list(node.input)
            for i, what in PER_COLUMN.items():
                if i < len(inputs) and inputs[i]:
                    name = f"{inputs[i]}.cols{lo}_{lo + size}"
                    array = tensor_array(inits[node.input[i]])  # spilled or not
                    graph.initializer.append(
                        numpy_helper.from_array(cut_columns(array, n, lo, lo + size), name))
                    inputs[i] = name
            pieces.append(helper.make_node(
                "MatMulNBits", inputs, [piece_out], name=f"{node.name}/cols{lo}_{lo + size}",
                domain="com.microsoft", **{**attrs, "N": size}))
            lo += size
        replace[id(node)] = pieces
        drop.add(id(split))
    nodes = []
    for node in graph.node:
        if id(node) in drop:
            continue
        nodes.extend(replace.get(id(node), [node]))
    del graph.node[:]
    graph.node.extend(nodes)
    used = {name for node in graph.node for name in node.input}
    for init in [i for i in graph.initializer if i.name not in used]:
        graph.initializer.remove(init)
    return len(drop)
