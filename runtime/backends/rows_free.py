"""A target graph without attention's minimum rows, for fast decoding.

Exact decoding needs every GroupQueryAttention to see at least two query rows per request
(export/attention_rows.py: a Pad before each attention, a Slice after, 13 shared nodes that
compute the padded seqlens). Fast decoding (`--fast-decode`) feeds `attention_min_rows` = 1,
where the pass appends no row, and its 74 nodes still run every step: 1-5% of a plain step on
SmolLM2-135M (docs/quantization.md, "The lean graph"). A target loaded for fast decoding
therefore runs the graph with the pass taken out:

    qkv --Pad--> GQA(q', seqlens_k', total', position_ids') --Slice--> out
becomes
    qkv --GQA(query_seqlens, seqlens_k, total_sequence_length, position_ids)--> out

At attention_min_rows = 1 the pass computes q' = query_seqlens, seqlens_k' = seqlens_k,
position_ids' = position_ids and total' = max(seqlens_k) + 1, which is the total the runtime
feeds (runtime/step_inputs.py), so the outputs are bitwise the same
(tests/test_lean_graph.py). The weights stay where they are: the graph is rewritten without
them and ONNX Runtime reads them from the engine folder's external data.
"""

from __future__ import annotations

import collections
from pathlib import Path

from trt_spec.runtime.graph_io import ATTENTION_MIN_ROWS

ROWS = "/" + ATTENTION_MIN_ROWS  # the prefix of export/attention_rows.py's nodes and tensors
# ONNX Runtime's session option: where a graph given as bytes finds its external data
EXTERNAL_FOLDER = "session.model_external_initializers_file_folder_path"


def strip_attention_rows(model):
    """A copy of one of our target graphs (onnx.ModelProto) without export/attention_rows.py's
    pass: each GroupQueryAttention reads its qkv and writes its output directly (no Pad /
    Slice), with the step's own seqlens; the shared nodes and the attention_min_rows input
    are gone. Initializers may be external references (loaded without their data)."""
    import onnx

    out = onnx.ModelProto()
    out.CopyFrom(model)
    graph = out.graph
    producers = {o: n for n in graph.node for o in n.output}
    readers = collections.defaultdict(list)
    for n in graph.node:
        for i in n.input:
            readers[i].append(n)
    for node in graph.node:
        if node.op_type != "GroupQueryAttention":
            continue
        pad = producers[node.input[0]]
        (slice_,) = readers[node.output[0]]
        assert pad.op_type == "Pad" and slice_.op_type == "Slice", (pad.name, slice_.name)
        node.input[0] = pad.input[0]
        for i, name in enumerate(node.input):
            if name.startswith(ROWS + "/"):
                node.input[i] = name[len(ROWS) + 1:]
        node.output[0] = slice_.output[0]
    kept = [n for n in graph.node if not n.name.endswith((ROWS + "/Pad", ROWS + "/Slice"))
            and not any(o.startswith(ROWS + "/") for o in n.output)]
    del graph.node[:]
    graph.node.extend(kept)
    inputs = [i for i in graph.input if i.name != ATTENTION_MIN_ROWS]
    del graph.input[:]
    graph.input.extend(inputs)
    used = {i for n in graph.node for i in n.input}
    for init in [i for i in graph.initializer if i.name not in used]:
        graph.initializer.remove(init)
    return out


def rows_free_model(path: Path) -> bytes | None:
    """The graph at `path` without the attention-rows pass, serialized without its weights
    (a session reads them from path's folder through EXTERNAL_FOLDER); None when the graph
    has no such pass, or the `onnx` package is missing (the graph then runs as it is, fed
    attention_min_rows = 1)."""
    try:
        import onnx
    except ImportError:
        return None
    model = onnx.load(str(path), load_external_data=False)
    if not any(i.name == ATTENTION_MIN_ROWS for i in model.graph.input):
        return None
    return strip_attention_rows(model).SerializeToString()
