"""Exactness as a property of the machine: the CPU as its kernels see it, the probe that picks
the row layout under which a row's logits do not depend on its step, its cache, and the
int8 weights widened for CPUs without VNNI."""

import json

import numpy as np
import onnxruntime as ort
import pytest

from trt_spec.runtime.backends import cpu, exact_rows
from trt_spec.runtime.speculation import cost_cache
from trt_spec.runtime.backends.ort import OrtTarget, make_session
from trt_spec.runtime.backends.exact_rows import FAST, ExactnessCache, RowRule, candidates, probe, shapes
from trt_spec.runtime.kv_cache import KVCache
from trt_spec.runtime.manifest import load_manifest
from trt_spec.runtime.step_inputs import SlotTokens, build_step_inputs


def test_cpu_flags_come_from_cpuid_and_name_a_kernel_family():
    flags = cpu.cpu_flags()
    assert set(flags) <= set(cpu.FEATURES)
    if "avx512f" in flags:
        assert "avx2" in flags  # every AVX-512 CPU has AVX2
    assert cpu.cpu_kind(("avx", "fma", "avx2")) == "avx2"
    assert cpu.cpu_kind(("avx2", "avx512f", "avx512bw", "avx512_vnni")) == "avx512-vnni"
    assert cpu.cpu_kind(("avx2", "avx512_vnni", "amx_tile", "amx_int8")) == "amx"


def test_step_min_rows_pads_columns_not_tokens():
    from trt_spec.runtime.config import ModelConfig

    config = ModelConfig(vocab_size=16, hidden_size=8, intermediate_size=8, num_layers=1,
                         num_heads=2, num_kv_heads=1, head_dim=4, max_position_embeddings=32)
    cache = KVCache(config, slots=3, max_len=16)
    a = cache.allocate()
    cache.lengths[a] = 5
    one = build_step_inputs(cache, [SlotTokens(a, [7], [0])], 32)
    two = build_step_inputs(cache, [SlotTokens(a, [7], [0])], 32, min_rows=2)
    assert one.feeds["input_ids"].shape == (1, 1) and two.feeds["input_ids"].shape == (1, 2)
    assert two.feeds["logits_index"].shape == (1, 2)  # the head runs 2 rows too
    assert two.feeds["query_seqlens"].tolist() == [1]  # the token count is unchanged
    assert two.feeds["seqlens_k"].tolist() == one.feeds["seqlens_k"].tolist() == [5]
    b = cache.allocate()
    both = build_step_inputs(cache, [SlotTokens(a, [7], [0]), SlotTokens(b, [3], [0])], 32,
                             min_rows=2)
    assert both.feeds["input_ids"].shape == (2, 1)  # 2 streams: 2 rows already


def test_shapes_cover_every_step_and_start_with_two_rows():
    got = shapes(3, 4)
    assert {(b, t) for b, t, _ in got} == {(b, t) for b in range(1, 4) for t in range(1, 5)} - {(1, 1)}
    assert got[0][0] * got[0][1] == 2
    assert all(b >= 2 and t >= 2 for b, t, ragged in got if ragged)


def test_probe_finds_a_rule_under_which_every_row_is_exact(tiny_engine_int4):
    """On this machine: the rule chosen makes every probed step's rows bitwise plain ones,
    and rules before it in the list were refused for a named step."""
    config = load_manifest(tiny_engine_int4).config
    target = OrtTarget(tiny_engine_int4 / "target.onnx", config.num_layers,
                       config.max_position_embeddings, exact_decode=False)
    found = probe(target, max_batch=3, max_tokens=4)
    assert found.holds, found.failed
    tried = candidates(target.rows_in_graph)
    assert tried.index(found.rule) == len(found.failed)
    assert all("step" in f for f in found.failed)
    assert found.plain_ms > 0 and found.fast_ms > 0
    assert found.cpu_flags == list(cpu.cpu_flags()) and found.onnxruntime == ort.__version__
    # what the probe promises, checked the way the engine meets it: one verification step
    target.exact_decode, target._exactness = True, found
    cache = KVCache(config, slots=2, max_len=24)
    a, b = cache.allocate(), cache.allocate()
    ids = [5, 17, 99, 3, 42, 8, 77, 61]
    target.step(cache, [SlotTokens(a, ids, [7]), SlotTokens(b, ids, [7])])
    verified = target.step(cache, [SlotTokens(a, [9, 10, 11], [0, 1, 2]),
                                   SlotTokens(b, [9], [0])]).logits
    cache.rewind(a, 8)
    for j, token in enumerate([9, 10, 11]):
        alone = target.step(cache, [SlotTokens(a, [token], [0])]).logits[0][0]
        np.testing.assert_array_equal(alone, verified[0][j])
    np.testing.assert_array_equal(verified[1][0], verified[0][0])


def test_probe_result_is_cached_by_engine_and_machine(tiny_engine_int4, tmp_path, monkeypatch):
    monkeypatch.setenv("TRT_SPEC_CACHE", str(tmp_path))
    files = {"target.onnx": {"sha256": "ab"}}
    key = exact_rows.probe_key(files, 2)
    assert key == exact_rows.probe_key(files, 2)
    assert key != exact_rows.probe_key(files, 1)
    assert key != exact_rows.probe_key({"target.onnx": {"sha256": "cd"}}, 2)
    cost = cost_cache.cost_key(files, "ort", 2, True)
    other = ("avx", "fma", "avx2") + (() if "avx512f" in cpu.cpu_flags() else ("avx512f",))
    monkeypatch.setattr(exact_rows, "cpu_flags", lambda: other)
    monkeypatch.setattr(cost_cache, "cpu_flags", lambda: other)
    assert exact_rows.probe_key(files, 2) != key  # other kernels, another answer
    assert cost_cache.cost_key(files, "ort", 2, True) != cost  # ... and other step costs
    monkeypatch.setattr(ort, "__version__", "0.0.1")
    assert exact_rows.probe_key(files, 2) != key

    config = load_manifest(tiny_engine_int4).config
    store = ExactnessCache.for_key("k")
    target = OrtTarget(tiny_engine_int4 / "target.onnx", config.num_layers,
                       config.max_position_embeddings, exact_decode=True, cover=(2, 3),
                       exactness_cache=store)
    saved = json.loads(store.path.read_text())["exactness"]
    assert saved["holds"] == target.exactness.holds and saved["max_batch"] == 2
    calls = []
    monkeypatch.setattr(exact_rows, "probe", lambda *a: calls.append(a))
    again = OrtTarget(tiny_engine_int4 / "target.onnx", config.num_layers,
                      config.max_position_embeddings, exact_decode=True, cover=(2, 3),
                      exactness_cache=store)
    assert not calls and again.rule == target.rule  # read, not probed


def test_nothing_holds_is_said_once_and_decoding_goes_on(tiny_engine_int4, monkeypatch, capsys):
    monkeypatch.setattr(exact_rows._Probe, "check", lambda self, want: "step 1x2: stream 0 row 0")
    monkeypatch.setattr(exact_rows, "_said", set())
    config = load_manifest(tiny_engine_int4).config
    for _ in range(2):
        target = OrtTarget(tiny_engine_int4 / "target.onnx", config.num_layers,
                           config.max_position_embeddings, exact_decode=True)
    err = capsys.readouterr().err
    assert err.count("exact decoding does not hold on this machine") == 1
    assert "step 1x2" in err and "bench's `same` column" in err
    assert not target.exactness.holds and target.rule == FAST
    cache = KVCache(config, slots=1, max_len=8)
    out = target.step(cache, [SlotTokens(cache.allocate(), [3, 4], [1])])
    assert out.logits[0].shape == (1, config.vocab_size)


def test_rule_texts():
    assert FAST.describe() == "no padding"
    assert RowRule(2, 2).describe() == "attention rows >= 2, step rows >= 2"
    assert RowRule(pad_requests=True).describe() == "1-token requests run as 2 tokens"


def test_widened_int8_weights_compute_the_same_products(tmp_path):
    """The rewrite for CPUs without VNNI (u8 x u8 with zero point 128) gives the products of
    the int8 form, on any CPU: the integer sums are exact either way."""
    onnx = pytest.importorskip("onnx")
    from tests.test_int8_rows import matmul_model
    from trt_spec.runtime.backends.int8_weights import widened_model

    rng = np.random.default_rng(3)
    w = (rng.standard_normal((256, 96)) * 0.05).astype(np.float32)
    path = tmp_path / "m.onnx"
    onnx.save(matmul_model(w, "int8-rows2"), str(path))  # two passes share one weight
    widened = onnx.load_from_string(widened_model(path))
    nodes = [n for n in widened.graph.node if n.op_type == "MatMulIntegerToFloat"]
    assert len(nodes) == 2 and all(len(n.input) == 6 and n.input[5] for n in nodes)
    inits = {i.name: i for i in widened.graph.initializer}
    assert inits[nodes[0].input[1]].data_type == onnx.TensorProto.UINT8
    x = rng.standard_normal((1, 5, 256)).astype(np.float32)
    onnx.save(widened, str(tmp_path / "widened.onnx"))
    # (on a CPU without VNNI make_session widens the original too: both then run u8 x u8)
    want = make_session(path).run(None, {"x": x})[0]
    got = make_session(tmp_path / "widened.onnx").run(None, {"x": x})[0]
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    plain = tmp_path / "plain.onnx"
    onnx.save(matmul_model(w, "int4"), str(plain))
    assert widened_model(plain) is None  # nothing to widen
