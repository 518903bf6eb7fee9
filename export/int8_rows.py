"""The int8-rows form's pieces (export/quantize.py lowers MatMuls with them): int8 weight
columns, and the graph nodes that quantize each row of a MatMul's input to 8 bits at run
time and multiply with com.microsoft MatMulIntegerToFloat (ONNX Runtime's integer GEMM: AMX
/ VNNI tiles on x86, whose cost barely grows with the rows a step verifies)."""

from __future__ import annotations

import numpy as np
from onnx import helper, numpy_helper


def quantize_int8_columns(w: np.ndarray):
    """w: [K, N] fp32 -> (q [K, N] int8, scales [N] fp32): symmetric, one scale per output
    column, scale = max|w| / 127; a third value (zero points) is None: there are none."""
    scale = np.abs(w).max(0) / 127.0
    scale = np.where(scale == 0, 1.0, scale).astype(np.float32)
    q = np.clip(np.round(w / scale), -127, 127).astype(np.int8)
    return q, scale, None


def dequantize_int8_columns(q, scales, zero_points, k: int, n: int) -> np.ndarray:
    return q.astype(np.float32) * scales


ROW_ZERO_POINT = 128  # the quantized rows are uint8 around 128 (MLAS's fast kernels are u8 x s8)


def rows_int8(graph, new_nodes, done: dict[str, tuple[str, str]], x: str, k: int
              ) -> tuple[str, str]:
    """x [.., K] -> (xq [.., K] uint8, scale [.., 1]) with x ~ (xq - 128) * scale, each row
    quantized by its own largest magnitude (scale = max|x_row| / 127), once per input tensor:

        x --Abs--ReduceMax(last axis)--Mul(1/127)--Max(tiny)--> scale
        x --QuantizeLinear(scale, zero points; one block per row)--> xq

    The zero points (128, one per row) are made once per graph, from the first input's scale:
    every MatMul input of a decoder's graph has the same rows ([batch, tokens, ..])."""
    if x not in done:
        consts = {"/rows_int8/last_axis": np.array([-1], np.int64),
                  "/rows_int8/inv127": np.array(1 / 127, np.float32),
                  "/rows_int8/tiny": np.array(1e-30, np.float32),
                  "/rows_int8/zp": np.full((1,), ROW_ZERO_POINT, np.uint8)}
        names = {i.name for i in graph.initializer}
        graph.initializer.extend(numpy_helper.from_array(v, n) for n, v in consts.items()
                                 if n not in names)
        a, m, raw, scale, xq = (f"{x}/rows_int8/{n}" for n in
                                ("abs", "max", "raw_scale", "scale", "q"))
        new_nodes.extend([
            helper.make_node("Abs", [x], [a], name=a),
            helper.make_node("ReduceMax", [a, "/rows_int8/last_axis"], [m], keepdims=1, name=m),
            helper.make_node("Mul", [m, "/rows_int8/inv127"], [raw], name=raw),
            helper.make_node("Max", [raw, "/rows_int8/tiny"], [scale], name=scale),
        ])
        if not done:  # the zero points of every row, once
            new_nodes.extend([
                helper.make_node("Shape", [scale], [ROW_SHAPE], name=ROW_SHAPE),
                helper.make_node("Expand", ["/rows_int8/zp", ROW_SHAPE], [ROW_ZERO_POINTS],
                                 name=ROW_ZERO_POINTS),
            ])
        new_nodes.append(helper.make_node("QuantizeLinear", [x, scale, ROW_ZERO_POINTS], [xq],
                                          axis=-1, block_size=k, name=xq))
        done[x] = (xq, scale)
    return done[x]


ROW_SHAPE = "/rows_int8/row_shape"
ROW_ZERO_POINTS = "/rows_int8/row_zero_points"


def rows_int8_error(new_nodes, x: str, x_rows: tuple[str, str], k: int) -> str:
    """x - dequantized(xq): what the 8-bit rows left out, for a second 8-bit pass."""
    xq, scale = x_rows
    back, error = f"{xq}/dequantized", f"{xq}/error"
    new_nodes.extend([
        helper.make_node("DequantizeLinear", [xq, scale, ROW_ZERO_POINTS], [back], axis=-1,
                         block_size=k, name=back),
        helper.make_node("Sub", [x, back], [error], name=error),
    ])
    return error


def int8_rows_matmul(new_nodes, passes: list[tuple[str, str]], prefix: str, output: str,
                     name: str) -> None:
    """y = sum over passes of (xq - 128) @ Wq * row_scale * column_scale, one
    com.microsoft MatMulIntegerToFloat a pass (the integer GEMM and both scalings; a second
    pass quantizes what the first left out)."""
    terms = [f"{name}/pass.{i}" if len(passes) > 1 else output for i in range(len(passes))]
    for i, ((xq, scale), term) in enumerate(zip(passes, terms)):
        new_nodes.append(helper.make_node(
            "MatMulIntegerToFloat", [xq, prefix + ".q", scale, prefix + ".scales",
                                     "/rows_int8/zp"], [term],
            name=f"{name}/MatMulIntegerToFloat.{i}", domain="com.microsoft"))
    if len(passes) > 1:
        new_nodes.append(helper.make_node("Sum", terms, [output], name=f"{name}/passes"))
