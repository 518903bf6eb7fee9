"""GPTQ and AWQ checkpoints: their layouts read exactly, and an exported engine whose
MatMulNBits weights are, bitwise, the checkpoint's dequantized weights.

Tiny random Llamas (tests/conftest.py make_tiny_hf) are quantized in each layout variant
(GPTQ old format asymmetric, GPTQ v2 symmetric, GPTQ desc_act, GPTQ by error feedback, AWQ
GEMM), exported at int4, and read back from the ONNX initializers."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
import torch
from onnx import numpy_helper

from trt_spec.export import awq, gptq
from trt_spec.export.int4_checkpoint import (QuantizedLinear, content_key, dequantize,
                                             dequantize_nbits, fused_codes, quantization_config,
                                             read_quantized)


def random_codes(n: int, k: int, group: int, seed: int, act_order: bool = False
                 ) -> QuantizedLinear:
    g = torch.Generator().manual_seed(seed)
    groups = k // group
    g_idx = torch.arange(k) // group
    if act_order:
        g_idx = g_idx[torch.randperm(k, generator=g)]
    return QuantizedLinear(torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8),
                           torch.randint(0, 16, (n, groups), generator=g, dtype=torch.uint8),
                           (torch.rand(n, groups, generator=g) * 0.1 + 1e-3).half(), g_idx,
                           group)


def assert_same(a: QuantizedLinear, b: QuantizedLinear):
    for field in ("q", "zeros", "scales", "g_idx"):
        assert torch.equal(getattr(a, field), getattr(b, field)), field
    assert a.group_size == b.group_size


# --- the layouts ---------------------------------------------------------------------------

def test_gptq_packs_eight_inputs_low_nibble_first_and_v1_stores_zero_minus_one():
    ql = QuantizedLinear(torch.arange(8, dtype=torch.uint8).repeat(8, 1),  # q[n, k] = k
                         torch.tensor([[0], [1], [2], [3], [4], [5], [6], [15]], dtype=torch.uint8),
                         torch.ones(8, 1, dtype=torch.float16), torch.zeros(8, dtype=torch.int64),
                         8)
    v2 = gptq.pack(ql)
    assert v2["qweight"].shape == (1, 8) and int(v2["qweight"][0, 0]) == 0x76543210
    assert int(v2["qzeros"][0, 0]) == int(np.int32(np.uint32(0xF6543210)))
    v1 = gptq.pack(ql, v1=True)  # z - 1, masked: z = 0 is stored as 15
    assert int(v1["qzeros"][0, 0]) == int(np.int32(np.uint32(0xE543210F)))
    assert_same(gptq.unpack(v1, {"group_size": 8}, "v1"), ql)
    assert_same(gptq.unpack(v2, {"group_size": 8, "checkpoint_format": "gptq_v2"}, "v2"), ql)


def test_awq_packs_eight_outputs_in_its_order():
    ql = QuantizedLinear(torch.arange(8, dtype=torch.uint8)[:, None].repeat(1, 8),  # q[n, k] = n
                         torch.arange(8, dtype=torch.uint8)[:, None],
                         torch.ones(8, 1, dtype=torch.float16), torch.zeros(8, dtype=torch.int64),
                         8)
    packed = awq.pack(ql)
    assert packed["qweight"].shape == (8, 1)
    assert int(packed["qweight"][0, 0]) == int(np.int32(np.uint32(0x75316420)))  # 0,2,4,6,1,3,5,7
    assert_same(awq.unpack(packed, {"group_size": 8}, "awq"), ql)


@pytest.mark.parametrize("v1", [True, False])
@pytest.mark.parametrize("act_order", [False, True])
def test_gptq_round_trip(v1, act_order):
    ql = random_codes(48, 64, 16, seed=1, act_order=act_order)
    qc = {"group_size": 16, "checkpoint_format": "gptq" if v1 else "gptq_v2"}
    back = gptq.unpack(gptq.pack(ql, v1=v1), qc, "m")
    assert_same(back, ql)
    assert back.act_order == act_order


def test_awq_round_trip():
    ql = random_codes(48, 64, 32, seed=2)
    assert_same(awq.unpack(awq.pack(ql), {"group_size": 32}, "m"), ql)


def test_dequantize_is_exact_and_its_fp16_rounding_is_the_fp16_kernel():
    ql = random_codes(64, 128, 32, seed=3, act_order=True)
    w = dequantize(ql)
    g = ql.g_idx
    exact = ql.scales.double()[:, g] * (ql.q.double() - ql.zeros.double()[:, g])
    assert torch.equal(w.double(), exact)  # every product is exact in fp32
    fp16_kernel = ql.scales[:, g] * (ql.q.half() - ql.zeros.half()[:, g])
    assert torch.equal(w.half(), fp16_kernel)


def test_layout_errors_name_the_tensor():
    parts = gptq.pack(random_codes(16, 32, 16, seed=4))
    parts["scales"] = parts["scales"][:, :8]
    with pytest.raises(ValueError, match="scales"):
        gptq.unpack(parts, {"group_size": 16}, "layer.q_proj")
    with pytest.raises(ValueError, match="checkpoint_format"):
        gptq.is_v1({"checkpoint_format": "marlin"})
    with pytest.raises(ValueError, match="version"):
        awq.check_version({"version": "gemv"})


# --- a tiny model in each layout, exported ----------------------------------------------------

def quantize_folder(hf_dir, out, variant: str):
    """The tiny model quantized and written in `variant`'s layout -> its folder."""
    from trt_spec.export.checkpoint import load_target
    from trt_spec.export.gptq_quantize import awq_config, gptq_config, quantize_target, write_folder

    target, config = load_target(hf_dir)
    act_order = variant == "gptq-desc-act"
    sym = variant == "gptq-v2-sym"
    sequences = ([[int(t) for t in torch.randint(3, 128, (24,), generator=torch.Generator()
                                                 .manual_seed(s))] for s in range(4)]
                 if variant in ("gptq-desc-act", "gptq-feedback") else None)
    group = 16 if sym else 32
    codes = quantize_target(target, sequences, group, sym=sym, act_order=act_order,
                            progress=lambda msg: None)
    qc = (awq_config(group) if variant == "awq" else
          gptq_config(group, sym, act_order, v1=variant != "gptq-v2-sym"))
    return write_folder(hf_dir, out, codes, config, qc)


VARIANTS = ["gptq-v1-asym", "gptq-v2-sym", "gptq-desc-act", "gptq-feedback", "awq"]


@pytest.fixture(scope="module", params=VARIANTS)
def quantized(request, tiny_hf_dir, tmp_path_factory):
    """(variant, its checkpoint folder, its int4 engine folder)."""
    from trt_spec.export.config import ExportConfig
    from trt_spec.export.pipeline import export_model

    root = tmp_path_factory.mktemp(request.param)
    folder = quantize_folder(tiny_hf_dir, root / "hf", request.param)
    engine = export_model(ExportConfig(str(folder), root / "engine", "int4"))
    return request.param, folder, engine


def checkpoint_weights(folder):
    """{content key: [K, N] fp32} of the checkpoint's fused weights, dequantized."""
    from trt_spec.export.checkpoint import read_safetensors

    hf = json.loads((folder / "config.json").read_text())
    _, codes = read_quantized(read_safetensors(folder), quantization_config(folder, hf), "t")
    fused = fused_codes(codes, hf["num_hidden_layers"], "t")
    return {key: dequantize(ql).T.numpy() for key, ql in fused.items()}


def engine_weights(engine):
    """The [K, N] weights each checkpoint MatMulNBits of target.onnx computes with, rows in
    the input's own order (its act_order Gather undone); the lean graph's pieces of one fused
    product (export/lean.py: gate and up, named <product>/cols<lo>_<hi>) joined again."""
    model = onnx.load(str(engine / "target.onnx"))
    inits = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    producers = {o: n for n in model.graph.node for o in n.output}
    out: dict[str, list[np.ndarray]] = {}
    for node in model.graph.node:
        if node.op_type != "MatMulNBits" or ".int4-checkpoint" not in node.input[1]:
            continue
        attrs = {a.name: a.i for a in node.attribute}
        gather = producers.get(node.input[0])
        perm = inits[gather.input[1]] if gather is not None and gather.op_type == "Gather" \
            and gather.input[1].endswith(".perm") else None
        out.setdefault(node.name.split("/cols")[0], []).append(dequantize_nbits(
            *(inits[x] for x in node.input[1:4]), attrs["K"], attrs["N"], attrs["block_size"],
            perm))
    return [np.concatenate(pieces, axis=1) for pieces in out.values()]


def test_engine_weights_are_the_checkpoints_bitwise(quantized):
    variant, folder, engine = quantized
    want = checkpoint_weights(folder)
    got = engine_weights(engine)
    assert len(got) == len(want) == 4 * 4  # qkv, o, gate_up, down in each of 4 layers
    for w in got:
        key = content_key(w)
        assert key in want, variant
        assert np.array_equal(w, want[key])
    manifest = json.loads((engine / "manifest.json").read_text())
    forms = manifest["graphs"]["target"]["weights"]
    assert forms["int4-checkpoint"] == {"matmuls": 16, "relative_error_median": 0.0,
                                        "relative_error_max": 0.0}
    model = onnx.load(str(engine / "target.onnx"), load_external_data=False)
    gathers = [n for n in model.graph.node if n.op_type == "Gather" and "act_order" in n.name]
    assert len(gathers) == (4 * 4 if variant == "gptq-desc-act" else 0)


def test_engine_logits_match_torch_on_the_dequantized_weights(quantized):
    """The ORT engine against the torch forward of the checkpoint's dequantized weights: only
    what ORT rounds is left (activations to int8 per block, accuracy level 4; the tied head
    read at 4 bits, its top logits at 8). Measured 0.03-0.04 relative error; for scale, the
    int4 engine of the tiny model's own fp32 weights is 0.40 off their torch forward, its int8
    engine 0.06."""
    from tests.test_draft_vocab import TOKENS, ort_logits, target_logits
    from trt_spec.export.checkpoint import load_target

    variant, folder, engine = quantized
    target, config = load_target(folder)
    want = target_logits(target).numpy()
    got = ort_logits(engine / "target.onnx", config, config.num_layers, None)
    err = np.abs(got - want).mean() / np.abs(want).mean()
    assert err < 0.1, (variant, err)
    assert (got.argmax(-1) == want.argmax(-1)).mean() >= 5 / 6, variant


@pytest.mark.parametrize("variant", ["gptq-v1-asym", "awq"])
def test_phi3_stores_qkv_and_gate_up_fused_and_reads_back_bitwise(variant, tmp_path):
    """Phi-3 checkpoints quantize self_attn.qkv_proj and mlp.gate_up_proj as one module each
    (its own names, not q/k/v and gate/up): written so, read back, every engine MatMulNBits
    is the checkpoint's weight bitwise."""
    from safetensors import safe_open

    from tests.rope_models import make_hf
    from trt_spec.export.config import ExportConfig
    from trt_spec.export.pipeline import export_model

    hf_dir = make_hf(tmp_path / "phi3", "phi3.5-mini")
    folder = quantize_folder(hf_dir, tmp_path / "q", variant)
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    assert "model.layers.0.self_attn.qkv_proj.qweight" in keys
    assert "model.layers.0.mlp.gate_up_proj.qweight" in keys
    assert not any(".q_proj." in k or ".gate_proj." in k for k in keys)
    engine = export_model(ExportConfig(str(folder), tmp_path / "engine", "int4"))
    want = checkpoint_weights(folder)
    got = engine_weights(engine)
    layers = json.loads((folder / "config.json").read_text())["num_hidden_layers"]
    assert len(got) == len(want) == 4 * layers
    for w in got:
        assert np.array_equal(w, want[content_key(w)])
