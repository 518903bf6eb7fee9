"""The int4+residual form's block sums, three ways, timed in a chain of MatMulNBits that has
a decoder's shapes (per layer: a 576 -> 576 product, 576 -> 1536, 1536 -> 576, and the
residual adds), against the same chain without the residual (int4-plain):

    concat   MatMul(x, block indicator [K, P]) then Concat(x, sums): what export writes
    reduce   Reshape(x, [-1, K/32, 32]), ReduceSum, Pad to P, Concat(x, sums)
    eye      one MatMul(x, [I | indicator]) that writes [x, sums] at once

    python scripts/residual_sums.py [--layers 30] [--rows 1,3] [--repeats 8]

Prints ms per forward (medians of interleaved repeats) and each form against int4-plain;
the three residual forms compute the same products (checked on one layer first).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from trt_spec.export.quantize import (BLOCK, quantize_int4, quantize_int4_residual,
                                      sums_width)
from trt_spec.runtime.backends.ort import make_session

FORMS = ("plain", "concat", "reduce", "eye")
HIDDEN, INTERMEDIATE = 576, 1536


class Chain:
    """Builds one form's graph; every form reads the same weights."""

    def __init__(self, form: str, weights: list[np.ndarray]):
        self.form, self.nodes, self.inits, self.shared = form, [], [], set()
        x = "x"
        for layer in range(len(weights) // 3):
            a = self.product(x, weights[3 * layer], f"l{layer}o")
            h = self.node("Add", [x, a], f"l{layer}h")
            g = self.product(h, weights[3 * layer + 1], f"l{layer}g")
            d = self.product(g, weights[3 * layer + 2], f"l{layer}d")
            x = self.node("Add", [h, d], f"l{layer}x")
        graph = helper.make_graph(
            self.nodes, form,
            [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["m", HIDDEN])],
            [helper.make_tensor_value_info(x, TensorProto.FLOAT, ["m", HIDDEN])], self.inits)
        opsets = [helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)]
        self.model = helper.make_model(graph, opset_imports=opsets)

    def node(self, op: str, inputs: list[str], out: str, **attrs) -> str:
        self.nodes.append(helper.make_node(op, inputs, [out], **attrs))
        return out

    def init(self, array: np.ndarray, name: str) -> str:
        if name not in self.shared:
            self.inits.append(numpy_helper.from_array(array, name))
            self.shared.add(name)
        return name

    def with_sums(self, x: str, k: int, tag: str) -> tuple[str, int]:
        p = sums_width(k)
        indicator = np.zeros((k, p), np.float32)
        indicator[np.arange(k), np.arange(k) // BLOCK] = 1
        if self.form == "concat":
            sums = self.node("MatMul", [x, self.init(indicator, f"ones{k}")], tag + "s")
        elif self.form == "reduce":
            shape = self.init(np.array([-1, k // BLOCK, BLOCK], np.int64), f"shape{k}")
            axis = self.init(np.array([-1], np.int64), "axis")
            pads = self.init(np.array([0, 0, 0, p - k // BLOCK], np.int64), f"pads{k}")
            sums = self.node("Reshape", [x, shape], tag + "r")
            sums = self.node("ReduceSum", [sums, axis], tag + "rs", keepdims=0)
            sums = self.node("Pad", [sums, pads], tag + "s")
        else:  # eye
            wide = np.concatenate([np.eye(k, dtype=np.float32), indicator], 1)
            return self.node("MatMul", [x, self.init(wide, f"eye{k}")], tag + "c"), k + p
        return self.node("Concat", [x, sums], tag + "c", axis=-1), k + p

    def product(self, x: str, w: np.ndarray, tag: str) -> str:
        k, n = w.shape
        if self.form == "plain":
            q, s, z = quantize_int4(w)
        else:
            x, k = self.with_sums(x, k, tag)
            q, s, z = quantize_int4_residual(w)
        inputs = [x, self.init(q, tag + "q"), self.init(s, tag + "sc"), self.init(z, tag + "z")]
        return self.node("MatMulNBits", inputs, tag + "y", domain="com.microsoft", K=k, N=n,
                         bits=4, block_size=BLOCK, accuracy_level=4)


def chain_weights(layers: int, seed: int = 0) -> list[np.ndarray]:
    """Each layer's three [K, N] weights, in the order Chain reads them."""
    rng = np.random.default_rng(seed)
    shapes = [(HIDDEN, HIDDEN), (HIDDEN, INTERMEDIATE), (INTERMEDIATE, HIDDEN)] * layers
    return [rng.standard_normal(s).astype(np.float32) * 0.02 for s in shapes]


def sessions(layers: int, folder: Path, seed: int = 0) -> dict:
    weights = chain_weights(layers, seed)
    folder.mkdir(parents=True, exist_ok=True)
    out = {}
    for form in FORMS:
        path = folder / f"{form}.onnx"
        onnx.save(Chain(form, weights).model, path)
        out[form] = make_session(path)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--rows", default="1,3", help="rows a forward reads, comma-separated")
    parser.add_argument("--repeats", type=int, default=8, help="interleaved rounds of 30 runs")
    args = parser.parse_args(argv)
    if args.layers < 1 or args.repeats < 1:
        parser.error(f"--layers {args.layers} and --repeats {args.repeats} must be at least 1")
    try:
        rows = [int(r) for r in args.rows.split(",")]
    except ValueError:
        parser.error(f"--rows {args.rows!r}: comma-separated integers, e.g. 1,3")
    rng = np.random.default_rng(1)
    with tempfile.TemporaryDirectory() as tmp:
        # one layer: over 30, the int8 activations' roundings compound past any tolerance
        one = sessions(1, Path(tmp) / "one")
        x = {"x": rng.standard_normal((2, HIDDEN)).astype(np.float32)}
        outs = {f: s.run(None, x)[0] for f, s in one.items()}
        for f in ("reduce", "eye"):
            err = np.abs(outs[f] - outs["concat"]).max() / np.abs(outs["concat"]).max()
            if err > 1e-2:
                raise SystemExit(f"{f} differs from concat by {err:.3g} of the output's range")
        runs = sessions(args.layers, Path(tmp) / "timed")
        for m in rows:
            x = {"x": rng.standard_normal((m, HIDDEN)).astype(np.float32)}
            times = {f: [] for f in FORMS}
            for _ in range(args.repeats):
                for f, s in runs.items():
                    t = time.perf_counter()
                    for _ in range(30):
                        s.run(None, x)
                    times[f].append((time.perf_counter() - t) / 30 * 1e3)
            base = float(np.median(times["plain"]))
            cells = [f"{f} {np.median(t):.3f} ms ({np.median(t) / base:.2f}x)"
                     for f, t in times.items()]
            print(f"rows {m}: " + ", ".join(cells))
    return 0


if __name__ == "__main__":
    sys.exit(main())
