"""The weight forms of export/quantize.py: what each reproduces, in NumPy and through ORT."""

import numpy as np
import pytest

onnx = pytest.importorskip("onnx")
from onnx import TensorProto, helper, numpy_helper
from trt_spec.export.quantize import (
    BLOCK,
    FORMS,
    RESIDUAL_STAGES,
    dequantize_int4,
    dequantize_int4_residual,
    matmuls_to_nbits,
    quantize_int4,
    quantize_int4_residual,
)
from trt_spec.runtime.backends.ort import make_session


def q4_1_weights(k: int, n: int, seed: int = 0) -> np.ndarray:
    """[K, N] weights on a Q4_1 grid, as a GGUF stores them: per 32-block an fp16 step d and
    minimum m (m / d fractional), every weight d*q + m with q in 0..15, 0 and 15 both used."""
    rng = np.random.default_rng(seed)
    blocks = k // BLOCK
    d = rng.uniform(0.002, 0.02, (n, blocks)).astype(np.float16).astype(np.float32)
    m = (-d * rng.uniform(2.0, 13.0, (n, blocks))).astype(np.float16).astype(np.float32)
    q = rng.integers(0, 16, (n, blocks, BLOCK))
    q[..., 0], q[..., 1] = 0, 15
    w = d[..., None] * q + m[..., None]  # (N, nb, 32)
    return np.ascontiguousarray(w.reshape(n, k).T)


def test_residual_form_reproduces_q4_1():
    w = q4_1_weights(96, 40)  # 3 blocks: an odd count of zero points
    got = dequantize_int4_residual(*quantize_int4_residual(w), 96, 40)
    # the residual (half a step at most) rides in int4 stages: each leaves 1/30 of its range
    step = np.ptp(w.T.reshape(40, 3, 32), -1).max() / 15
    np.testing.assert_allclose(got, w, rtol=0, atol=step / 30 ** RESIDUAL_STAGES)
    # the plain int4 form cannot: its integer zero point shifts whole blocks
    plain = dequantize_int4(*quantize_int4(w), 96, 40)
    assert np.abs(plain - w).mean() > 10 * np.abs(got - w).mean()


def test_residual_form_is_round_to_nearest_on_any_weights():
    rng = np.random.default_rng(1)
    w = (rng.standard_normal((64, 24)) + rng.uniform(-2, 2, (1, 24))).astype(np.float32)
    got = dequantize_int4_residual(*quantize_int4_residual(w), 64, 24)
    blocks = w.T.reshape(24, 2, BLOCK)
    step = (blocks.max(-1) - blocks.min(-1)) / 15  # (N, nb)
    err = np.abs(got - w).T.reshape(24, 2, BLOCK)
    assert np.all(err <= step[..., None] * (0.5 + 1 / 30 ** RESIDUAL_STAGES))


def matmul_model(w: np.ndarray) -> onnx.ModelProto:
    k, n = w.shape
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"], name="/proj/MatMul")], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "tokens", k])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", "tokens", n])],
        [numpy_helper.from_array(w, "w")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def run(model: onnx.ModelProto, x: np.ndarray, tmp_path) -> list[np.ndarray]:
    """Opened as the runtime opens graphs (its process-wide thread pool, once one exists)."""
    path = tmp_path / "model.onnx"
    onnx.save(model, str(path))
    return make_session(path).run(None, {"x": x})


@pytest.mark.parametrize("form", FORMS)
def test_forms_through_onnx_runtime(form, tmp_path):
    """Each form's graph computes x @ W for Q4_1 weights: the residual form as closely as
    ORT's int8 activation rounding allows, the plain int4 form off by its block shifts."""
    w = q4_1_weights(192, 96, seed=2)
    x = np.random.default_rng(3).standard_normal((2, 3, 192)).astype(np.float32)
    model = matmul_model(w)
    assert matmuls_to_nbits(model, lambda output, shape: form) == 1
    got = run(model, x, tmp_path)[0]
    want = x @ w
    err = np.abs(got - want).mean() / np.abs(want).mean()
    # measured: int8 0.006, int4+residual 0.005, int4 0.048
    limit = {"int8": 0.02, "int4+residual": 0.02, "int4": 1.0}[form]
    assert err < limit, (form, err)
    if form == "int4":
        assert err > 0.025  # the shift the residual removes is real on this data


def test_block_sums_are_shared_by_the_weights_that_read_one_input(tmp_path):
    w1, w2 = q4_1_weights(128, 64, seed=4), q4_1_weights(128, 96, seed=5)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w1"], ["y1"]),
         helper.make_node("MatMul", ["x", "w2"], ["y2"])], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 2, 128])],
        [helper.make_tensor_value_info("y1", TensorProto.FLOAT, [1, 2, 64]),
         helper.make_tensor_value_info("y2", TensorProto.FLOAT, [1, 2, 96])],
        [numpy_helper.from_array(w1, "w1"), numpy_helper.from_array(w2, "w2")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    assert matmuls_to_nbits(model, lambda output, shape: "int4+residual") == 2
    sums = [n for n in model.graph.node if n.output[0].endswith("/block_sums")]
    assert len(sums) == 1
    assert {n.input[0] for n in model.graph.node if n.op_type == "MatMulNBits"} == {
        "x/with_block_sums"}
    assert {n.input[0] for n in model.graph.node if n.op_type == "MatMul"} == {"x"}
    x = np.random.default_rng(6).standard_normal((1, 2, 128)).astype(np.float32)
    y1, y2 = run(model, x, tmp_path)
    for got, w in ((y1, w1), (y2, w2)):
        assert np.abs(got - x @ w).mean() < 0.02 * np.abs(x @ w).mean()
