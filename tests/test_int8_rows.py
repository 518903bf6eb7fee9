"""The int8-rows precision: 8-bit weight columns times 8-bit activation rows (MatMulIntegerToFloat),
the smoothing that moves activation outliers into the weights, and the exactness that
speculative decoding needs from it: a row's result does not depend on the rows beside it."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from trt_spec.export.quantize import (dequantize_int8_columns, matmuls_to_nbits,
                                      quantize_int8_columns)
from trt_spec.runtime.backends.ort import make_session
from trt_spec.runtime.sampling import SamplingParams
from trt_spec.runtime.settings import SpeculationConfig
from trt_spec.runtime.scheduler import generate_ids


def matmul_model(w: np.ndarray, form: str) -> onnx.ModelProto:
    """A graph y = x @ w with w lowered to `form`."""
    k, n = w.shape
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, "T", k])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, "T", n])],
                              [numpy_helper.from_array(w, "w")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)])
    assert matmuls_to_nbits(model, lambda output, shape: form) == 1
    onnx.checker.check_model(model)
    return model


def one_matmul(w: np.ndarray, form: str, folder) -> ort.InferenceSession:
    """matmul_model's session, opened as the runtime opens graphs (the process's pool)."""
    model = matmul_model(w, form)
    assert any(n.op_type == "MatMulIntegerToFloat" for n in model.graph.node)
    path = folder / f"{form}-{w.shape[0]}x{w.shape[1]}.onnx"
    onnx.save(model, str(path))
    return make_session(path)


def test_int8_columns_round_trip():
    w = np.random.default_rng(0).standard_normal((96, 40)).astype(np.float32)
    w[:, 3] = 0  # a zero column: scale 1, nothing divided by 0
    q, scales, zps = quantize_int8_columns(w)
    assert q.dtype == np.int8 and q.shape == w.shape and scales.shape == (40,) and zps is None
    back = dequantize_int8_columns(q, scales, None, 96, 40)
    assert np.all(np.abs(back - w) <= scales / 2 + 1e-7)
    assert np.all(back[:, 3] == 0)


@pytest.mark.parametrize("form", ["int8-rows", "int8-rows2"])
def test_rows_are_quantized_each_on_its_own(form, tmp_path):
    """Bitwise: a row computed among others equals the row computed alone (what makes
    speculative greedy output equal plain greedy output), and close to x @ w."""
    rng = np.random.default_rng(1)
    w = (rng.standard_normal((128, 160)) * 0.05).astype(np.float32)
    session = one_matmul(w, form, tmp_path)
    x = rng.standard_normal((1, 5, 128)).astype(np.float32)
    x[0, 2] *= 100  # one loud row must not coarsen the others
    x[0, 4] = 0  # an all-zero row: no NaN
    together = session.run(None, {"x": x})[0]
    for t in range(5):
        alone = session.run(None, {"x": x[:, t:t + 1]})[0]
        np.testing.assert_array_equal(alone[0, 0], together[0, t])
    assert np.all(together[0, 4] == 0)
    want = x @ w
    error = np.linalg.norm(together - want) / np.linalg.norm(want)
    assert error < 0.02, error


def test_two_passes_are_closer_than_one(tmp_path):
    rng = np.random.default_rng(2)
    w = (rng.standard_normal((256, 320)) * 0.05).astype(np.float32)
    x = rng.standard_normal((1, 8, 256)).astype(np.float32)
    x[..., 7] *= 40  # an outlier channel, as LLM activations have
    want = x @ dequantize_int8_columns(*quantize_int8_columns(w), 256, 320)  # rows' error alone
    errors = {form: np.linalg.norm(one_matmul(w, form, tmp_path).run(None, {"x": x})[0] - want)
              for form in ("int8-rows", "int8-rows2")}
    assert errors["int8-rows2"] < errors["int8-rows"] / 3, errors


def passes(w: np.ndarray, form: str) -> int:
    return sum(n.op_type == "MatMulIntegerToFloat" for n in matmul_model(w, form).graph.node)


def test_int8_rows_takes_two_passes_where_the_matmul_narrows():
    """The down projection (K > N) reads its input in two passes; a widening MatMul in one
    (q/k/v, read by GroupQueryAttention, in two: the engine test's graphs)."""
    assert passes(np.ones((128, 64), np.float32), "int8-rows") == 2
    assert passes(np.ones((64, 128), np.float32), "int8-rows") == 1
    assert passes(np.ones((64, 128), np.float32), "int8-rows2") == 2


def test_smoothing_keeps_the_model_and_evens_the_inputs(tiny_hf_dir):
    """Moving channel scales into the weights leaves the fp32 outputs as they were, and the
    inputs the 8-bit rows see flatter (their largest channel nearer their typical one)."""
    import torch

    from trt_spec.export.checkpoint import load_target
    from trt_spec.export.model import empty_cache
    from trt_spec.export.smooth import input_maxima, smooth

    target, config = load_target(tiny_hf_dir)
    gen = torch.Generator().manual_seed(0)
    seqs = [torch.randint(3, config.vocab_size, (24,), generator=gen).tolist() for _ in range(3)]

    def run(ids):
        n = len(ids)
        pos = torch.arange(n)[None]
        with torch.inference_mode():
            return target(torch.tensor(ids)[None], pos, torch.tensor([n - 1], dtype=torch.int32),
                          torch.tensor([n], dtype=torch.int32), torch.tensor(n, dtype=torch.int32),
                          pos, *empty_cache(config, 1, n))[0]

    with torch.no_grad():  # outlier channels, as trained models have
        for layer in target.layers:
            layer.input_layernorm[::7] *= 30
            layer.post_attention_layernorm[::5] *= 30
    before = [run(s) for s in seqs]
    maxima = input_maxima(target, seqs)
    assert set(maxima) == {f"{i}.{m}" for i in range(config.num_layers)
                           for m in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")}
    spread = {k: float(v.max() / v.median()) for k, v in maxima.items()}
    assert smooth(target, maxima) == 4 * config.num_layers
    for b, s in zip(before, seqs):
        torch.testing.assert_close(run(s), b, rtol=1e-3, atol=1e-3)  # fp32 rounding only
    after = input_maxima(target, seqs)
    for name in ("0.qkv_proj", "0.gate_up_proj"):
        assert float(after[name].max() / after[name].median()) < spread[name] / 2, name


@pytest.fixture(scope="module")
def tiny_int8_rows(tiny_hf_dir, tmp_path_factory, monkeypatch_module):
    """The tiny model with a noisy-copy draft, at int8-rows (random ids as calibration)."""
    from tests.conftest import make_tiny_hf
    from trt_spec.export import smooth
    from trt_spec.export.config import ExportConfig
    from trt_spec.export.pipeline import export_model

    rng = np.random.default_rng(3)
    monkeypatch_module.setattr(smooth, "calibration_sequences", lambda hf_dir, progress=print: [
        rng.integers(3, 128, 40).tolist() for _ in range(4)])
    draft = make_tiny_hf(tmp_path_factory.mktemp("tiny-draft8"), seed=1,
                         noisy_copy_of=tiny_hf_dir, noise=0.02)
    return export_model(ExportConfig(str(tiny_hf_dir),
                                     tmp_path_factory.mktemp("engines") / "tiny-int8-rows",
                                     "int8-rows", drafters={"vanilla": str(draft)}))


@pytest.fixture(scope="module")
def monkeypatch_module():
    mp = pytest.MonkeyPatch()
    yield mp
    mp.undo()


def test_int8_rows_engine_speculates_losslessly(tiny_int8_rows, tiny_engine):
    """Greedy speculative output (vanilla draft, n-gram lookup; batch 1 and 3) equals the
    engine's plain greedy output, and the engine follows the fp32 one (teacher forcing)."""
    from trt_spec.runtime.generator import Generator
    from trt_spec.runtime.manifest import load_manifest
    from trt_spec.tools.fidelity import fidelity

    graph = load_manifest(tiny_int8_rows).graph("target")
    assert graph["precision"] == "int8-rows"
    # one pass for o and gate/up, two for q/k/v and down: 2 of each per layer
    assert graph["weights"]["int8-rows"]["matmuls"] == 2 * 4
    assert graph["weights"]["int8-rows2"]["matmuls"] == 2 * 4
    prompts = [[5, 17, 99, 3, 17, 99], [42, 8, 77, 61, 23, 11, 90, 8, 77], [4, 4]]
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    plain = [s.output_ids for s in generate_ids(Generator(tiny_int8_rows, max_batch=3), 
        prompts, params)]
    for method in ("vanilla", "ngram"):
        gen = Generator(tiny_int8_rows, method=method, max_batch=3,
                        speculation=SpeculationConfig(num_draft_tokens=4, fallback=False))
        for batch in (1, 3):
            streams = [s for i in range(0, 3, batch)
                       for s in generate_ids(gen, prompts[i:i + batch], params)]
            assert [s.output_ids for s in streams] == plain, (method, batch)
        if method == "vanilla":
            assert sum(s.stats.accepted for s in streams) > 0
    report = fidelity(Generator(tiny_engine, max_batch=1), Generator(tiny_int8_rows, max_batch=1),
                      prompts, 24)
    # (a random tiny model has near-ties: 0.92 / 0.0055 when written; a wrong scale is far off)
    assert report["greedy_agreement"] >= 0.8 and report["mean_kl"] < 0.03, report


def test_export_offers_int8_rows():
    from click.testing import CliRunner

    from trt_spec.cli import main

    r = CliRunner().invoke(main, ["export", "--help"])
    assert r.exit_code == 0 and "int8-rows" in r.output
