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


def test_released_export_is_the_same_graph(tiny_hf_dir):
    """export_target(release=True) serializes the same proto as without release, and leaves
    the module's weights on the meta device."""
    from trt_spec.export.checkpoint import load_target
    from trt_spec.export.onnx_export import export_target

    kept, _ = load_target(tiny_hf_dir)
    released, _ = load_target(tiny_hf_dir)
    want = export_target(kept)
    got = export_target(released, release=True)
    for proto in (want, got):  # the tracer's stack traces name call sites, not weights
        for node in proto.graph.node:
            keep = [m for m in node.metadata_props if m.key != "pkg.torch.onnx.stack_trace"]
            del node.metadata_props[:]
            node.metadata_props.extend(keep)
    assert got.SerializeToString() == want.SerializeToString()
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
