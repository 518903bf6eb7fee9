"""Export's memory habits change nothing it writes: the lazy, meta-device checkpoint load, the
target's weights let go while its graph is serialized, and the in-place quantizers give the
same tensors and graphs as the eager forms they replace."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")


def test_lazy_load_matches_an_eager_copy(tiny_hf_dir):
    """load_target (lazy mapping, meta module, tensors assigned) == a module built for real
    with the eagerly read checkpoint copied into it: every parameter and buffer, bitwise."""
    import json

    from trt_spec.export.checkpoint import (config_from_hf, load_into, load_target,
                                            read_safetensors, target_state_dict)
    from trt_spec.export.model import TargetModel

    lazy, config = load_target(tiny_hf_dir)
    eager = TargetModel(config_from_hf(json.loads((tiny_hf_dir / "config.json").read_text())))
    load_into(eager, target_state_dict(read_safetensors(tiny_hf_dir), config))
    got, want = lazy.state_dict(keep_vars=False), eager.state_dict()
    assert sorted(got) == sorted(want)
    for key in want:
        torch.testing.assert_close(got[key], want[key], rtol=0, atol=0, msg=key)
    for name in ("cos_cache", "sin_cache"):  # non-persistent: made for real after the load
        torch.testing.assert_close(getattr(lazy, name), getattr(eager, name), rtol=0, atol=0)


def test_spilled_export_saves_the_same_graph(tiny_hf_dir, tmp_path):
    """export_target(spill=...) (the module's weights let go, the graph's in a scratch file)
    then quantized and saved == the same without spilling: the .onnx (stack traces aside) and
    its .data bytes; the module's weights are left on the meta device."""
    import onnx

    from trt_spec.export.checkpoint import load_target
    from trt_spec.export.onnx_export import export_target, save_with_external_data
    from trt_spec.export.quantize import matmuls_to_nbits, tie_embedding_int8

    kept, _ = load_target(tiny_hf_dir)
    released, _ = load_target(tiny_hf_dir)
    saved = {}
    for name, proto in (("kept", export_target(kept)),
                        ("spilled", export_target(released, spill=tmp_path / "t.spill"))):
        aliases = tie_embedding_int8(proto, rescore_top=8)
        matmuls_to_nbits(proto, lambda output, shape: "int4")
        (tmp_path / name).mkdir()
        save_with_external_data(proto, tmp_path / name / "target.onnx", aliases, {})
        graph = onnx.load(tmp_path / name / "target.onnx", load_external_data=False)
        for node in graph.graph.node:  # the tracer's stack traces name call sites
            keep = [m for m in node.metadata_props if m.key != "pkg.torch.onnx.stack_trace"]
            del node.metadata_props[:]
            node.metadata_props.extend(keep)
        saved[name] = (graph.SerializeToString(),
                       (tmp_path / name / "target.onnx.data").read_bytes())
    assert any(i.data_location == onnx.TensorProto.EXTERNAL for i in graph.graph.initializer)
    assert saved["spilled"] == saved["kept"]
    assert all(p.is_meta for p in released.parameters())
    assert not any(p.is_meta for p in kept.parameters())


@pytest.mark.parametrize("shape", [(64, 48), (96, 1000)])
def test_in_place_quantizers_match_the_formula(shape):
    """quantize_int8 / quantize_int4 (in-place steps) == the expressions they replace."""
    from trt_spec.export.quantize import BLOCK, _pack_int4, quantize_int4, quantize_int8

    w = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    w[:BLOCK, 0] = 0.0  # an all-zero block: scale 1
    k, n = shape
    wt = w.T.reshape(n, k // BLOCK, BLOCK)
    scale = np.abs(wt).max(-1) / 127.0
    scale = np.where(scale == 0, 1.0, scale).astype(np.float32)
    q8 = (np.clip(np.round(wt / scale[..., None]), -127, 127) + 128).astype(np.uint8)
    got = quantize_int8(w)
    np.testing.assert_array_equal(got[0], q8)
    np.testing.assert_array_equal(got[1], scale.reshape(-1))

    lo, hi = np.minimum(wt.min(-1), 0.0), np.maximum(wt.max(-1), 0.0)
    s4 = ((hi - lo) / 15.0)
    s4 = np.where(s4 == 0, 1.0, s4).astype(np.float32)
    zp = np.clip(np.round(-lo / s4), 0, 15).astype(np.uint8)
    q4 = np.clip(np.round(wt / s4[..., None]) + zp[..., None], 0, 15).astype(np.uint8)
    for a, b in zip(quantize_int4(w), _pack_int4(q4, s4, zp)):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("quantizer", ["quantize_int8", "quantize_int4"])
def test_chunked_quantizers_match_one_call(quantizer, monkeypatch):
    """By columns in chunks (by_columns) == the whole matrix at once, bitwise; an odd number of
    blocks per column (the int4 zero points' padding) included."""
    from trt_spec.export import quantize

    w = np.random.default_rng(1).standard_normal((96, 1000)).astype(np.float32)
    whole = getattr(quantize, quantizer)(w)
    monkeypatch.setattr(quantize, "CHUNK_ELEMENTS", 96 * 7)  # 7 columns a chunk, 143 chunks
    chunked = getattr(quantize, quantizer)(w)
    assert len(chunked) == len(whole) == 3
    for a, b in zip(chunked, whole):
        np.testing.assert_array_equal(a, b)


def test_lazy_tensors_read_what_safetensors_reads(tmp_path):
    """LazyTensors' plain reads == safetensors' load_file: every dtype a checkpoint holds,
    scalars and empty tensors included."""
    from safetensors.torch import load_file, save_file

    from trt_spec.export.checkpoint import LazyTensors

    g = torch.Generator().manual_seed(0)
    tensors = {"f32": torch.randn(3, 5, generator=g),
               "bf16": torch.randn(7, 2, generator=g).bfloat16(),
               "f16": torch.randn(4, generator=g).half(), "i64": torch.arange(6).reshape(2, 3),
               "u8": torch.arange(9, dtype=torch.uint8), "scalar": torch.tensor(2.5),
               "empty": torch.zeros(0, 4)}
    save_file(tensors, tmp_path / "model.safetensors")
    want = load_file(tmp_path / "model.safetensors")
    got = LazyTensors(tmp_path)
    assert sorted(got) == sorted(want)
    for key in want:
        assert got[key].dtype == want[key].dtype and got[key].shape == want[key].shape, key
        assert torch.equal(got[key], want[key]), key
