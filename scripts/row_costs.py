"""What one more verified row costs, per form a verify step's MatMuls can take in ONNX Runtime.

Each form is one single-MatMul ONNX graph of a K x N weight (random: speed does not depend
on the values), run on T rows of input for T = 1, 2, 4, 5, 8, 16 at 2 intra-op threads.
Everything is timed in one process, interleaved (every form and T in turn, `--repeats`
times), each run the last of a block of 3 of the same shape (as tools/step_costs.py: ORT's
first run of a shape after another costs more). Reported: the fastest of the repeats (what
the kernel costs when it has both cores: on a 2-core machine that others load, one of two
threads descheduled stalls a parallel kernel, and medians then measure the load) and the
median. The forms:

    nbits4       MatMulNBits, 4 bits, block 32, uint8 zero points, accuracy level 4 (int8
                 compute): the int4 / int4-plain engines' MatMuls
    nbits4-fp32  the same weights at accuracy level 0 (dequantize + fp32 GEMM)
    nbits8       MatMulNBits, 8 bits, block 32, accuracy level 4: the int8 engines'
    int8-rows    int8 weight columns, each input row quantized to 8 bits at run time
                 (Abs, ReduceMax, Mul, Max, QuantizeLinear), MatMulIntegerToFloat
                 (export/int8_rows.py: the int8-rows engines')
    dq-matmul    DynamicQuantizeMatMul (com.microsoft): the same int8 weights, the input
                 quantized with one scale for the whole tensor
    fp32         MatMul on the dequantized int4 weights held as fp32 (8x int4's bytes)

"row-exact" says whether a row's result is bitwise the same computed alone and among T rows
(exact decoding needs it): per-tensor quantization of the input (dq-matmul) cannot be.

    .venv/bin/python scripts/row_costs.py [--shapes 576x1536 2048x8192 ...] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from trt_spec.export.int8_rows import int8_rows_matmul, quantize_int8_columns, rows_int8  # noqa: E402
from trt_spec.export.quantize import dequantize_int4, quantize_int4, quantize_int8  # noqa: E402

ROWS = (1, 2, 4, 5, 8, 16)
# SmolLM2-135M (q/gate/up, down, head) and 1B-3B models' projections (Llama-3.2-1B gate/up
# and down, a 4096-wide square, Llama-3.2-3B up, Qwen2.5-1.5B up)
SHAPES = ("576x1536", "1536x576", "576x49152", "2048x8192", "8192x2048", "4096x4096",
          "3072x8192", "1536x8960")
FORMS = ("nbits4", "nbits4-fp32", "nbits8", "int8-rows", "dq-matmul", "fp32")


def graph(name: str, nodes: list, inits: list, k: int, n: int) -> onnx.ModelProto:
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["T", k])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["T", n])
    model = helper.make_model(helper.make_graph(nodes, name, [x], [y], inits),
                              opset_imports=[helper.make_opsetid("", 21),
                                             helper.make_opsetid("com.microsoft", 1)])
    model.ir_version = 10
    return model


def nbits(w: np.ndarray, bits: int, accuracy: int) -> onnx.ModelProto:
    k, n = w.shape
    q, scales, zp = quantize_int4(w) if bits == 4 else quantize_int8(w)
    inits = [numpy_helper.from_array(np.ascontiguousarray(a), name)
             for a, name in ((q, "q"), (scales, "scales"), (zp, "zp"))]
    node = helper.make_node("MatMulNBits", ["x", "q", "scales", "zp"], ["y"], domain="com.microsoft",
                            K=k, N=n, bits=bits, block_size=32, accuracy_level=accuracy)
    return graph(f"nbits{bits}", [node], inits, k, n)


def int8_rows(w: np.ndarray) -> onnx.ModelProto:
    k, n = w.shape
    q, scales, _ = quantize_int8_columns(w)
    model = graph("int8-rows", [], [numpy_helper.from_array(q, "w.q"),
                                    numpy_helper.from_array(scales, "w.scales")], k, n)
    nodes: list = []
    x_rows = rows_int8(model.graph, nodes, {}, "x", k)
    int8_rows_matmul(nodes, [x_rows], "w", "y", "/w")
    model.graph.node.extend(nodes)
    return model


def dq_matmul(w: np.ndarray) -> onnx.ModelProto:
    k, n = w.shape
    q, scales, _ = quantize_int8_columns(w)
    inits = [numpy_helper.from_array(q, "q"), numpy_helper.from_array(scales, "scales"),
             numpy_helper.from_array(np.zeros(n, np.int8), "zp")]
    node = helper.make_node("DynamicQuantizeMatMul", ["x", "q", "scales", "zp"], ["y"],
                            domain="com.microsoft")
    return graph("dq-matmul", [node], inits, k, n)


def fp32(w: np.ndarray) -> onnx.ModelProto:
    k, n = w.shape
    wd = dequantize_int4(*quantize_int4(w), k, n).astype(np.float32)
    return graph("fp32", [helper.make_node("MatMul", ["x", "w"], ["y"])],
                 [numpy_helper.from_array(np.ascontiguousarray(wd), "w")], k, n)


BUILD = {"nbits4": lambda w: nbits(w, 4, 4), "nbits4-fp32": lambda w: nbits(w, 4, 0),
         "nbits8": lambda w: nbits(w, 8, 4), "int8-rows": int8_rows, "dq-matmul": dq_matmul,
         "fp32": fp32}


def session(model: onnx.ModelProto, folder: Path, threads: int) -> ort.InferenceSession:
    path = folder / f"{model.graph.name}.onnx"
    onnx.save(model, path, save_as_external_data=True, location=path.name + ".data")
    opts = ort.SessionOptions()
    opts.intra_op_num_threads, opts.inter_op_num_threads = threads, 1
    opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
    opts.log_severity_level = 3
    try:
        return ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])
    except RuntimeError:  # the process made ORT's shared pool first (a test run): use it
        opts = ort.SessionOptions()
        opts.use_per_session_threads = False
        opts.log_severity_level = 3
        return ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])


def row_exact(sess: ort.InferenceSession, x: np.ndarray, rows) -> bool:
    """Row 0 of every T-row product bitwise equal to row 0 computed alone."""
    alone = sess.run(None, {"x": x[:1]})[0][0]
    return all(np.array_equal(sess.run(None, {"x": x[:t]})[0][0], alone) for t in rows)


def time_shape(k: int, n: int, forms: list[str], repeats: int, threads: int,
               rows=ROWS) -> dict:
    """{form: {"us": {T: fastest µs}, "median_us": {T: median µs}, "row_exact": bool}} for
    one K x N weight."""
    rng = np.random.default_rng(0)
    w = (rng.standard_normal((k, n)) * 0.02).astype(np.float32)
    x = rng.standard_normal((max(rows), k)).astype(np.float32)
    # the first row's scale far from the others': per-tensor input scales then show
    x[1:] *= 3.0
    with tempfile.TemporaryDirectory() as tmp:
        sessions = {f: session(BUILD[f](w), Path(tmp), threads) for f in forms}
        del w
        times = {f: {t: [] for t in rows} for f in forms}
        for r in range(repeats + 1):  # the first pass warms up
            for f, sess in sessions.items():
                for t in rows:
                    feed = {"x": x[:t]}
                    for _ in range(3):
                        t0 = time.perf_counter()
                        sess.run(None, feed)
                        elapsed = time.perf_counter() - t0
                    if r:
                        times[f][t].append(elapsed)
        return {f: {"us": {t: 1e6 * min(v) for t, v in times[f].items()},
                    "median_us": {t: 1e6 * statistics.median(v) for t, v in times[f].items()},
                    "row_exact": row_exact(sessions[f], x, rows)} for f in forms}


def table(results: dict) -> str:
    rows = list(next(iter(next(iter(results.values())).values()))["us"])
    last = rows[-1]
    head = (f"{'shape':<10} {'form':<12} " + " ".join(f"{f'T={t}':>8}" for t in rows)
            + f"  c({last})/c(1) row-exact")
    lines = [head + "   (µs, fastest of the repeats)", "-" * len(head)]
    for shape, forms in results.items():
        for f, r in forms.items():
            us = r["us"]
            lines.append(f"{shape:<10} {f:<12} " + " ".join(f"{us[t]:8.0f}" for t in rows)
                         + f"  {us[last] / us[1]:9.2f} {'yes' if r['row_exact'] else 'NO':>9}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), help="KxN")
    ap.add_argument("--forms", nargs="+", default=list(FORMS), choices=FORMS)
    ap.add_argument("--rows", nargs="+", type=int, default=list(ROWS))
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    results = {}
    for shape in args.shapes:
        k, n = (int(v) for v in shape.lower().split("x"))
        results[shape] = time_shape(k, n, args.forms, args.repeats, args.threads, args.rows)
        print(table({shape: results[shape]}).split("\n", 2)[-1], flush=True)
        if args.json:
            args.json.write_text(json.dumps(results, indent=1))
    print(table(results))


if __name__ == "__main__":
    main()
