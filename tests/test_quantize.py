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
from tests.script_util import load_script
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
    # measured: int8 0.006, int4+residual 0.006, int4 0.048, int8-rows(2) 0.006 (K > N: two passes)
    limit = {"int8": 0.02, "int4+residual": 0.02, "int4": 1.0, "int8-rows": 0.03,
             "int8-rows2": 0.02}[form]
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


def tied_model(e: np.ndarray) -> onnx.ModelProto:
    """ids -> Gather(E) = emb, and h -> MatMul(h, Transpose(E)) = logits: a tied head."""
    vocab, hidden = e.shape
    graph = helper.make_graph(
        [helper.make_node("Gather", ["table", "ids"], ["emb"]),
         helper.make_node("Transpose", ["table"], ["table_t"], perm=[1, 0]),
         helper.make_node("MatMul", ["h", "table_t"], ["logits"])], "g",
        [helper.make_tensor_value_info("ids", TensorProto.INT64, ["batch", "tokens"]),
         helper.make_tensor_value_info("h", TensorProto.FLOAT, ["batch", "tokens", hidden])],
        [helper.make_tensor_value_info("emb", TensorProto.FLOAT, ["batch", "tokens", hidden]),
         helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", "tokens", vocab])],
        [numpy_helper.from_array(e, "table")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize("top", [0, 16])
def test_tied_head_rescores_its_top_logits_from_the_int8_rows(top, tmp_path):
    """The tied head as one int8 table (top 0), or a 4-bit copy whose `top` highest logits per
    row are computed again from the int8 rows: those equal the int8 head's logits (in fp32,
    closer than the 8-bit kernel's int8 activations get), the argmax is the int8 head's, the
    rest are the 4-bit copy's. The embedding reads the int8 rows either way."""
    from trt_spec.export.quantize import dequantize_int8, quantize_int8, tie_embedding_int8

    rng = np.random.default_rng(7)
    vocab, hidden = 512, 64
    e = (rng.standard_normal((vocab, hidden)) * 0.05).astype(np.float32)
    model = tied_model(e)
    aliases = tie_embedding_int8(model, rescore_top=top)
    assert aliases == ({} if top else {"table.int8.rows": "table.int8.q",
                                       "table.int8.rows.scales": "table.int8.scales",
                                       "table.int8.rows.zp": "table.int8.zp"})
    ops = [n.op_type for n in model.graph.node]
    assert ops.count("TopK") == (1 if top else 0) and "Transpose" not in ops
    ids = rng.integers(0, vocab, (2, 3))
    h = rng.standard_normal((2, 3, hidden)).astype(np.float32)
    path = tmp_path / "model.onnx"
    onnx.save(model, str(path))
    emb, logits = make_session(path).run(None, {"ids": ids, "h": h})
    e8 = dequantize_int8(*quantize_int8(e.T), hidden, vocab).T  # [vocab, H]: the int8 rows
    np.testing.assert_allclose(emb, e8[ids], rtol=0, atol=1e-6)
    exact = h @ e8.T
    assert (logits.argmax(-1) == exact.argmax(-1)).all()
    if not top:
        assert np.abs(logits - exact).max() < 0.02 * np.abs(exact).max()  # int8 activations
        return
    rescored = np.abs(logits - exact) < 1e-5  # the top of the 4-bit logits, in fp32
    assert (rescored.sum(-1) >= top).all()  # (a tail value may fall as close by chance)
    assert np.take_along_axis(rescored, exact.argmax(-1)[..., None], -1).all()
    e4 = dequantize_int4(*quantize_int4(e.T), hidden, vocab).T
    approx = h @ e4.T  # what the 4-bit kernel computes, up to its int8 activations
    assert np.abs(logits - approx)[~rescored].max() < 0.02 * np.abs(exact).max()
    assert np.abs(logits - exact)[~rescored].max() > 1e-3  # the tail is approximate


def test_int4_reads_a_tied_head_at_4_bits_and_int4_head8_at_8(tmp_path):
    """What export writes per precision for a tied head: int4 (the default) and int4-plain
    the 4-bit copy with each row's top 128 (int4-plain: 16) rescored, int4-head8 and int8 the
    8-bit head."""
    from trt_spec.export.pipeline import export_graph

    e = (np.random.default_rng(8).standard_normal((512, 64)) * 0.05).astype(np.float32)
    heads, tops = {}, {}
    for precision in ("int4", "int4-plain", "int4-head8", "int8"):
        export_graph(lambda: tied_model(e), tmp_path, precision, precision, "ort", ([], []))
        graph = onnx.load(str(tmp_path / f"{precision}.onnx"), load_external_data=False).graph
        nodes = graph.node
        tops[precision] = [int(numpy_helper.to_array(i)[0]) for i in graph.initializer
                           if i.name == "/lm_head/top"]
        heads[precision] = sorted((n.op_type, next((a.i for a in n.attribute if a.name == "bits"),
                                                   None)) for n in nodes
                                  if n.name.startswith("/lm_head"))
    rescored = sorted([("MatMulNBits", 4), ("TopK", None), ("GatherBlockQuantized", 8),
                       ("Unsqueeze", None), ("MatMul", None), ("Squeeze", None),
                       ("ScatterElements", None)])
    assert heads["int4"] == heads["int4-plain"] == rescored
    assert tops == {"int4": [128], "int4-plain": [16], "int4-head8": [], "int8": []}
    assert heads["int4-head8"] == heads["int8"] == [("MatMulNBits", 8)]


def test_residual_sums_script_forms_compute_the_residual_product(tmp_path):
    """scripts/residual_sums.py times three ways of appending the block sums: each must
    compute x @ W with W as the residual form holds it, and int4-plain with its own blocks."""
    script = load_script("residual_sums")
    runs = script.sessions(1, tmp_path, seed=3)
    weights = script.chain_weights(1, seed=3)
    x = np.random.default_rng(4).standard_normal((2, 576)).astype(np.float32)

    def chain(dequantize, quantize):
        w = [dequantize(*quantize(wi), *wi.shape) for wi in weights]
        h = x + x @ w[0]
        return h + (h @ w[1]) @ w[2]

    residual = chain(dequantize_int4_residual, quantize_int4_residual)
    for form in ("concat", "reduce", "eye"):
        # (int8 activations put each form ~0.4% off; plain and residual differ by ~8% here)
        out = runs[form].run(None, {"x": x})[0]
        assert np.abs(out - residual).max() < 0.01 * np.abs(residual).max(), form
    plain = chain(dequantize_int4, quantize_int4)
    assert np.abs(runs["plain"].run(None, {"x": x})[0] - plain).max() < 0.01 * np.abs(plain).max()
