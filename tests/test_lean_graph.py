"""The lean int4 graph (export/lean.py): integer-zero-point weights, no node onnxruntime-genai's
graph does without, and exact decoding still holding on it."""

import collections

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from trt_spec.export.lean import unfuse_split_products
from trt_spec.export.quantize import quantize_int4, quantize_int8

ort = pytest.importorskip("onnxruntime")


def fused_product(k: int, n: int, bits: int, sizes=None, seed: int = 0) -> onnx.ModelProto:
    """x [B, T, K] --MatMulNBits(N)--> [B, T, N] --Split(last axis)--> pieces, then a Mul of the
    first two (as SiLU's gate * up reads them)."""
    w = (np.random.default_rng(seed).standard_normal((k, n)) * 0.05).astype(np.float32)
    q, scales, zp = (quantize_int4 if bits == 4 else quantize_int8)(w)
    inits = [numpy_helper.from_array(q, "w.q"), numpy_helper.from_array(scales, "w.scales"),
             numpy_helper.from_array(zp, "w.zp")]
    split_inputs = ["y"]
    if sizes is not None:
        inits.append(numpy_helper.from_array(np.array(sizes, np.int64), "sizes"))
        split_inputs.append("sizes")
    parts = len(sizes) if sizes else 2
    split_attrs = {} if sizes else {"num_outputs": 2}
    nodes = [
        helper.make_node("MatMulNBits", ["x", "w.q", "w.scales", "w.zp"], ["y"], name="fused",
                         domain="com.microsoft", K=k, N=n, bits=bits, block_size=32,
                         accuracy_level=4),
        helper.make_node("Split", split_inputs, [f"p{i}" for i in range(parts)], axis=-1,
                         **split_attrs),
        helper.make_node("Mul", ["p0", "p1"], ["gated"]),
    ]
    outputs = ["gated"] + [f"p{i}" for i in range(parts)]
    graph = helper.make_graph(
        nodes, "fused", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["B", "T", k])],
        [helper.make_tensor_value_info(o, TensorProto.FLOAT, None) for o in outputs], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18),
                                                   helper.make_opsetid("com.microsoft", 1)])


def run(model: onnx.ModelProto, x: np.ndarray, folder) -> list[np.ndarray]:
    """The runtime's own session (make_session: on the process's shared thread pool once
    another test has made it, where a session with its own threads is refused)."""
    from trt_spec.runtime.backends.ort import make_session

    path = folder / f"m{len(list(folder.iterdir()))}.onnx"
    onnx.save(model, path)
    return make_session(path, threads=1).run(None, {"x": x})


@pytest.mark.parametrize("bits,sizes", [(4, None), (8, None), (4, [80, 80, 32])])
def test_unfused_products_are_bitwise_the_fused_columns(bits, sizes, tmp_path):
    """Each piece of the Split becomes its own MatMulNBits over the same codes: bitwise the
    fused product's columns, at 1, 2 and 5 rows."""
    k, n = 128, 192
    fused = fused_product(k, n, bits, sizes)
    lean = onnx.ModelProto()
    lean.CopyFrom(fused)
    assert unfuse_split_products(lean) == 1
    ops = collections.Counter(node.op_type for node in lean.graph.node)
    assert ops == {"MatMulNBits": len(sizes or [0, 0]), "Mul": 1}
    assert {i.name for i in lean.graph.initializer}.isdisjoint({"w.q", "w.scales", "w.zp"})
    for t in (1, 2, 5):
        x = np.random.default_rng(t).standard_normal((2, t, k)).astype(np.float32)
        for got, want in zip(run(lean, x, tmp_path), run(fused, x, tmp_path)):
            np.testing.assert_array_equal(got, want)


def test_a_product_read_by_more_than_the_split_stays_fused():
    model = fused_product(64, 64, 4)
    model.graph.output.append(helper.make_tensor_value_info("y", TensorProto.FLOAT, None))
    assert unfuse_split_products(model) == 0
    assert [n.op_type for n in model.graph.node] == ["MatMulNBits", "Split", "Mul"]


@pytest.fixture(scope="module")
def tiny_engine_int4_plain(tiny_hf_dir, tmp_path_factory):
    from trt_spec.export.config import ExportConfig
    from trt_spec.export.pipeline import export_model

    return export_model(ExportConfig(str(tiny_hf_dir), tmp_path_factory.mktemp("engines")
                                     / "tiny-int4-plain", "int4-plain"))


def test_int4_plain_graph_has_no_residual_and_no_split(tiny_engine_int4_plain, tiny_engine_int4):
    """int4-plain: gate and up as two MatMulNBits, no block sums (MatMul + Concat), no Split;
    the default int4 (Q4_1's residual) keeps its fused gate/up and block sums."""
    from trt_spec.runtime.manifest import load_manifest

    layers = load_manifest(tiny_engine_int4_plain).config.num_layers

    def ops(engine):
        graph = onnx.load(str(engine / "target.onnx"), load_external_data=False).graph
        return collections.Counter(node.op_type for node in graph.node)

    lean, default = ops(tiny_engine_int4_plain), ops(tiny_engine_int4)
    assert lean["Split"] == lean["MatMul"] == 0
    assert default["Split"] == layers and default["MatMul"] == 4 * layers  # block sums
    assert lean["MatMulNBits"] == default["MatMulNBits"] + layers
    assert lean["Concat"] == default["Concat"] - 4 * layers  # the block sums' Concats


def test_exact_decoding_holds_on_the_lean_graph(tiny_hf_dir, tiny_engine_int4_plain):
    """The runtime's exact-decoding checks, run on the lean int4-plain engine: one-token steps
    bitwise equal verification rows (batch 1 and 2, into the scratch row), a 1-token row of a
    ragged step equals decoding it alone, and attention rows in the graph equal padding in the
    runtime."""
    from tests import test_ort_target as checks

    for exact in (True, False):
        checks.test_exact_decode_one_token_steps_equal_verification_rows(
            tiny_hf_dir, tiny_engine_int4_plain, exact)
        checks.test_attention_rows_in_graph_equal_runtime_padding(
            tiny_hf_dir, tiny_engine_int4_plain, exact)
    checks.test_exact_decode_one_token_row_of_a_ragged_step(tiny_hf_dir, tiny_engine_int4_plain)


def _steps(target, config):
    """Logits and per-token outputs of a ragged prefill, a ragged step and 1-token steps up
    to the cache's last row (batch 2)."""
    from trt_spec.runtime.kv_cache import KVCache
    from trt_spec.runtime.step_inputs import SlotTokens

    ids = [5, 17, 99, 3, 42, 8, 77, 61, 23, 11, 90, 4]
    cache = KVCache(config, slots=2, max_len=12)
    a, b = cache.allocate(), cache.allocate()
    steps = [target.step(cache, [SlotTokens(a, ids[:6], [5]), SlotTokens(b, ids[:4], [0, 3])]),
             target.step(cache, [SlotTokens(a, ids[6:7], [0]), SlotTokens(b, ids[4:7], [0, 2])])]
    for token in ids[7:12]:
        steps.append(target.step(cache, [SlotTokens(a, [token], [0])]))
    steps.append(target.step(cache, [SlotTokens(b, [9], [0])]))
    return [x for s in steps for x in [*s.logits, *s.rows.values()]]


def test_fast_decoding_runs_the_graph_without_attention_rows(tiny_engine_int4_plain):
    """A target loaded for fast decoding runs its graph with the attention-rows pass taken
    out (runtime/backends/rows_free.py): no attention_min_rows input, and bitwise the
    outputs of the graph as exported fed attention_min_rows = 1."""
    from trt_spec.runtime.backends.exact_rows import FAST
    from trt_spec.runtime.backends.ort import OrtTarget
    from trt_spec.runtime.backends.rows_free import rows_free_model
    from trt_spec.runtime.graph_io import ATTENTION_MIN_ROWS
    from trt_spec.runtime.manifest import load_manifest

    config = load_manifest(tiny_engine_int4_plain).config
    path = tiny_engine_int4_plain / "target.onnx"
    fast = OrtTarget(path, config.num_layers, config.max_position_embeddings, exact_decode=False)
    exported = OrtTarget(path, config.num_layers, config.max_position_embeddings,
                         exact_decode=True, cover=(2, 3))
    assert fast.rows_dropped and not fast.rows_in_graph
    assert ATTENTION_MIN_ROWS not in {i.name for i in fast.session.get_inputs()}
    assert exported.rows_in_graph and not exported.rows_dropped
    stripped = onnx.load_from_string(rows_free_model(path))
    ops = collections.Counter(n.op_type for n in stripped.graph.node)
    assert ops["Pad"] == ops["Slice"] == 0
    assert not any(ATTENTION_MIN_ROWS in n.name or any(ATTENTION_MIN_ROWS in o for o in n.output)
                   for n in stripped.graph.node)
    with exported.using(FAST):
        want = _steps(exported, config)
    got = _steps(fast, config)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)


def test_fast_generator_loads_the_rows_free_target(tiny_engine_int4_plain):
    """Through the engine folder's manifest (its inputs name attention_min_rows): a fast
    generator loads and decodes; an exact one keeps the rows."""
    from trt_spec.runtime.generator import Generator
    from trt_spec.runtime.sampling import SamplingParams
    from trt_spec.runtime.scheduler import generate_ids

    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    for exact in (False, True):
        gen = Generator(str(tiny_engine_int4_plain), max_len=64, threads=1, prefix_cache=False,
                        exact_decode=exact)
        assert gen.target.rows_dropped == (not exact)
        (stream,) = generate_ids(gen, [[5, 17, 99, 3]], params, "none", None)
        assert len(stream.output_ids) == 6
