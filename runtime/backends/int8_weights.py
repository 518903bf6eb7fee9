"""int8-rows on x86 CPUs without VNNI: unsigned weights, so ONNX Runtime's integer GEMM is exact.

The int8-rows form (export/int8_rows.py) multiplies uint8 activation rows by int8 weight
columns with com.microsoft MatMulIntegerToFloat. On x86 with VNNI (AVX-512 VNNI, AVX-VNNI,
AMX) MLAS multiplies u8 x s8 into 32-bit sums. Without it (AVX2 only) its u8 x s8 kernel
adds each pair of products into 16 bits with saturation (vpmaddubsw): 255 x 127 x 2 = 64,770
does not fit, and results go wrong by up to ~20% (measured under an emulated AVX2 CPU:
max relative error 0.21 with 8-bit weights, 4e-8 with 7-bit weights or with u8 x u8).

So on such a CPU the weights are widened at load: w + 128 as uint8, with zero point 128 per
column, the same products exactly ((w + 128) - 128 = w); MLAS's u8 x u8 kernel widens to 16
bits before it multiplies and cannot saturate. The engine folder is not changed. Editing the
graph needs the `onnx` package (the export extra); without it the load is refused with what
to do.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from trt_spec.runtime.backends.cpu import cpu_flags

OP = "MatMulIntegerToFloat"
VNNI = ("avx512_vnni", "avx_vnni", "amx_int8")


def saturates() -> bool:
    """True on an x86 CPU whose u8 x s8 integer GEMM sums pairs in 16 bits (no VNNI)."""
    flags = cpu_flags()
    return "avx2" in flags and not any(f in flags for f in VNNI)


def _has_signed_weights(path: Path) -> bool:
    """Cheap check on the graph's bytes: does the file name the op at all?"""
    with open(path, "rb") as f:
        return OP.encode() in f.read()


def widened_model(path: Path) -> bytes | None:
    """The graph at `path` with every int8 weight of MatMulIntegerToFloat made uint8 with zero
    point 128 (module docstring), serialized; None when it has no such weight."""
    if not _has_signed_weights(path):
        return None
    try:
        import onnx
        from onnx import numpy_helper
    except ImportError:
        raise RuntimeError(
            f"{path}: an int8-rows graph on a CPU without VNNI ({', '.join(cpu_flags())}) must "
            "have its int8 weights widened at load, which needs the `onnx` package: `pip "
            "install onnx`, or export the model with --precision int4 (the default) for this "
            "machine") from None
    model = onnx.load(str(path))  # with its external data: the weights are rewritten
    graph = model.graph
    inits = {i.name: i for i in graph.initializer}
    widened: dict[str, str] = {}  # int8 weight -> its zero points' name
    for node in graph.node:
        if node.op_type != OP or node.input[1] not in inits:
            continue
        w = inits[node.input[1]]
        if w.name not in widened and w.data_type != onnx.TensorProto.INT8:
            continue  # (a weight two passes share is widened by the first)
        if len(node.input) > 5 and node.input[5]:
            continue  # zero points of its own: not the form export writes
        if w.name not in widened:
            q = numpy_helper.to_array(w)
            w.CopyFrom(numpy_helper.from_array((q.astype(np.int16) + 128).astype(np.uint8),
                                               w.name))
            zp = f"{w.name}/zero_points_u8"
            graph.initializer.append(numpy_helper.from_array(
                np.full(q.shape[-1], 128, np.uint8), zp))
            widened[w.name] = zp
        inputs = list(node.input) + [""] * (5 - len(node.input))
        del node.input[:]
        node.input.extend(inputs[:5] + [widened[w.name]] + inputs[6:])
    if not widened:
        return None
    return model.SerializeToString()
