"""Exact decoding inside the graph: a minimum number of query rows per attention call.

ONNX Runtime's GroupQueryAttention multiplies a request's attention weights by V with MLAS's
one-row kernel when the request has one query row and with the general kernel otherwise; the
two round differently (~1e-7), and on int4 graphs (int8 activations) that flips near-tie
tokens. So that a token's logits are the same whether it was decoded alone or verified among
drafts, every attention call must see at least two query rows per request.

The runtime used to get there by running each 1-token request as two tokens, which made every
MatMul of the step two rows too. This pass asks only the attention for the second row: the
graph takes `attention_min_rows` ([] int32: 2 for exact decoding, 1 for the one-row kernels)
and every GroupQueryAttention reads its input with junk rows appended when T is shorter:

    qkv [B, T, D] --Pad(max(m - T, 0) rows of zeros)--> [B, T', D] --GQA(q', seqlens_k', ...)
                  --> [B, T', D] --Slice(:T)--> [B, T, D]                   m = attention_min_rows
    q'         = max(query_seqlens, m) for active rows (query_seqlens > 0)
    seqlens_k' = seqlens_k + q' - query_seqlens
    total'     = max(seqlens_k') + 1

With m = 1 the graph is the plain one (no row appended, q' = q). With m = 2 a request's extra
row is its row q (a padding row of the step when q < T, the appended row when T = 1):
its keys and values land at cache row past + q, past the stream's length (the cache's scratch
row at most), overwritten later like any rewound row; its output is sliced away. The rows that
count are computed exactly as before: the MatMuls keep M = T rows and attention's row i sees
the same keys.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper

from trt_spec.runtime.graph_io import ATTENTION_MIN_ROWS as INPUT

SPEC = {"name": INPUT, "dtype": "int32", "shape": []}  # its manifest input entry


def pad_attention_rows(model: onnx.ModelProto) -> bool:
    """In place: every com.microsoft GroupQueryAttention reads `attention_min_rows` rows per
    active request at least (module docstring). Returns False (and changes nothing) for a
    graph without GroupQueryAttention."""
    graph = model.graph
    if not any(n.op_type == "GroupQueryAttention" for n in graph.node):
        return False
    inputs = {i.name for i in graph.input}
    for name in ("position_ids", "seqlens_k", "query_seqlens", "total_sequence_length"):
        assert name in inputs, name
    p = f"/{INPUT}"

    def const(name: str, value) -> str:
        graph.initializer.append(numpy_helper.from_array(np.asarray(value), f"{p}/{name}"))
        return f"{p}/{name}"

    zero, one = const("zero", np.array(0, np.int32)), const("one", np.array(1, np.int32))
    zeros4 = const("zeros4", np.zeros(4, np.int64))
    zeros3 = const("zeros3", np.zeros(3, np.int64))
    start, axis = const("start", np.array([0], np.int64)), const("axis", np.array([1], np.int64))
    shared = [
        # junk rows to append: attention_min_rows - T when positive (a 1-token step), else 0
        helper.make_node("Shape", ["input_ids"], [f"{p}/T"], start=1, end=2),
        helper.make_node("Cast", [INPUT], [f"{p}/min_rows"], to=onnx.TensorProto.INT64),
        helper.make_node("Sub", [f"{p}/min_rows", f"{p}/T"], [f"{p}/short"]),
        helper.make_node("Max", [f"{p}/short", const("zero64", np.array([0], np.int64))],
                         [f"{p}/junk"]),
        # Pad's pads: [begins..., ends...]; junk rows at the end of axis 1 (new_tokens)
        helper.make_node("Concat", [zeros4, f"{p}/junk", start], [f"{p}/pads_qkv"], axis=0),
        helper.make_node("Concat", [zeros3, f"{p}/junk"], [f"{p}/pads_pos"], axis=0),
        helper.make_node("Pad", ["position_ids", f"{p}/pads_pos"], [f"{p}/position_ids"],
                         mode="constant"),  # a junk row sits at position 0: any in-range one
        # per active request (query_seqlens > 0): at least attention_min_rows query rows
        helper.make_node("Max", ["query_seqlens", INPUT], [f"{p}/rows"]),
        helper.make_node("Greater", ["query_seqlens", zero], [f"{p}/active"]),
        helper.make_node("Where", [f"{p}/active", f"{p}/rows", "query_seqlens"],
                         [f"{p}/query_seqlens"]),
        helper.make_node("Sub", [f"{p}/query_seqlens", "query_seqlens"], [f"{p}/extra"]),
        helper.make_node("Add", ["seqlens_k", f"{p}/extra"], [f"{p}/seqlens_k"]),
        # GQA attends over total_sequence_length keys where a request has one row: it must be
        # exactly the longest row (a larger bound changed the one-row results)
        helper.make_node("ReduceMax", [f"{p}/seqlens_k"], [f"{p}/last"], keepdims=0),
        helper.make_node("Add", [f"{p}/last", one], [f"{p}/total_sequence_length"]),
    ]
    renamed = {name: f"{p}/{name}" for name in
               ("position_ids", "seqlens_k", "query_seqlens", "total_sequence_length")}
    nodes = []
    for node in graph.node:
        if node.op_type != "GroupQueryAttention":
            nodes.append(node)
            continue
        qkv, out = node.input[0], node.output[0]
        nodes.append(helper.make_node("Pad", [qkv, f"{p}/pads_qkv"], [f"{qkv}{p}"],
                                      mode="constant", name=f"{node.name}{p}/Pad"))
        gqa = helper.make_node(
            "GroupQueryAttention", [f"{qkv}{p}"] + [renamed.get(i, i) for i in node.input[1:]],
            [f"{out}{p}"] + list(node.output[1:]), name=node.name, domain=node.domain)
        gqa.attribute.extend(node.attribute)
        nodes.append(gqa)
        nodes.append(helper.make_node("Slice", [f"{out}{p}", start, f"{p}/T", axis], [out],
                                      name=f"{node.name}{p}/Slice"))
    del graph.node[:]
    graph.node.extend(shared + nodes)
    graph.input.append(helper.make_tensor_value_info(INPUT, onnx.TensorProto.INT32, []))
    return True
