"""RoPE scaling (linear, dynamic NTK, llama3, yarn, longrope, partial rotary) and the Phi-3
architecture against transformers, on tiny random models whose configs are published configs
shrunk (tests/rope_models.py), at positions below and above each scaling threshold: the
tables and the torch module for every model, the TensorRT-lowered graph for Phi-4-mini's
shape, and the config.json spellings and refusals (tests/test_rope_engines.py: the ORT
graphs, the runtime and speculative decoding).

The length-dependent kinds decide per token by its own length p + 1 (export/rope.py), which
is transformers' rule when it decodes one token per call with a cache; that is the reference
here. Where transformers' one-shot forward differs (positions past the switch), the difference
is asserted too, so the documented behaviour is the tested one.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from tests.rope_models import (LENGTH_DEPENDENT, MODELS, NAMES, VOCAB, cached_logits,  # noqa: E402
                               hf_model, make_hf)
from trt_spec.export.checkpoint import config_from_hf, load_target  # noqa: E402
from trt_spec.export.model import empty_cache, rope_tables  # noqa: E402

# fp32 on both sides; bounds as tests/test_families.py
ATOL, RTOL = 2e-4, 1e-4


def span(name: str) -> tuple[int, int]:
    """(prefill, total): a prefill that ends 4 tokens before the threshold, then decoding to
    12 positions past it."""
    threshold = MODELS[name][3]
    return threshold - 4, min(threshold + 12, max_positions_of(hf_config_dict(name)))


def hf_config_dict(name: str) -> dict:
    from tests.rope_models import hf_config

    hf = hf_config(name).to_dict()
    hf["architectures"] = [MODELS[name][0]]
    return hf


def max_positions_of(hf: dict) -> int:
    return config_from_hf(hf).max_position_embeddings


def ids_of(length: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(3, VOCAB, length).tolist()


@pytest.fixture(scope="module", params=NAMES)
def model_hf(request, tmp_path_factory):
    return request.param, make_hf(tmp_path_factory.mktemp(request.param), request.param)


def test_tables_equal_transformers_rotary(model_hf):
    """Row p of cos / sin (attention factor folded in) equals transformers' rotary embedding
    at position p when it is called one position per call in order (its cached decoding):
    every row of the table, below and above the threshold."""
    name, folder = model_hf
    _, config = load_target(folder)
    cos, sin = rope_tables(config)
    assert cos.shape == (config.max_position_embeddings, config.rotary_dim // 2)
    rotary = hf_model(folder).model.rotary_emb
    half = config.rotary_dim // 2
    x = torch.zeros(1)
    for p in range(config.max_position_embeddings):
        want_cos, want_sin = rotary(x, torch.tensor([[p]]))
        # float32 angles on transformers' side: p * inv_freq rounds at ~6e-8 * p
        torch.testing.assert_close(cos[p], want_cos[0, 0, :half], atol=4e-5, rtol=0)
        torch.testing.assert_close(sin[p], want_sin[0, 0, :half], atol=4e-5, rtol=0)


def torch_steps(model, config, ids: list[int], sizes: list[int]) -> torch.Tensor:
    """The export module run step by step (sizes: tokens per step) over one cache -> logits
    [len(ids), V]."""
    past = empty_cache(config, 1, len(ids))
    out, start = [], 0
    with torch.no_grad():
        for n in sizes:
            total = start + n
            logits, _, _, *past = model(
                torch.tensor([ids[start:total]]), torch.arange(start, total)[None],
                torch.tensor([total - 1], dtype=torch.int32), torch.tensor([n], dtype=torch.int32),
                torch.tensor(len(ids), dtype=torch.int32), torch.arange(n)[None], *past)
            out.append(logits[0])
            start = total
    return torch.cat(out)


def step_sizes(prefill: int, total: int) -> list[int]:
    """A prefill, then 1- and 3-token steps (verification-shaped) up to `total`."""
    sizes, start = [prefill], prefill
    for n in [1, 3] * total:
        n = min(n, total - start)
        if n == 0:
            break
        sizes.append(n)
        start += n
    return sizes


def test_torch_module_equals_transformers(model_hf):
    """The export module over a prefill and 1- / 3-token steps crossing the threshold equals
    transformers decoding one token per call with a cache, and so does the training forward
    over the whole sequence at once; a one-shot transformers forward equals it too below the
    threshold, and for the static kinds everywhere. Past the switch, the length-dependent
    kinds differ from the one-shot forward (export/rope.py)."""
    name, folder = model_hf
    model, config = load_target(folder)
    prefill, total = span(name)
    ids = ids_of(total, seed=1)
    got = torch_steps(model, config, ids, step_sizes(prefill, total))
    want = cached_logits(hf_model(folder), ids, prefill)
    torch.testing.assert_close(got, want, atol=ATOL, rtol=RTOL)
    assert (got.argmax(-1) == want.argmax(-1)).all()
    # the training forward (train/forward.py: one batched pass, no cache) reads the same tables
    from trt_spec.train.forward import causal_forward

    with torch.no_grad():
        hidden, _ = causal_forward(model, torch.tensor([ids]))
        torch.testing.assert_close(model.head(hidden[0]), got, atol=ATOL, rtol=RTOL)
    threshold = MODELS[name][3]
    with torch.no_grad():
        one_shot = hf_model(folder)(torch.tensor([ids])).logits[0]
        below = hf_model(folder)(torch.tensor([ids[:threshold]])).logits[0]
    torch.testing.assert_close(got[:threshold], below, atol=ATOL, rtol=RTOL)
    if name in LENGTH_DEPENDENT:
        assert (got[threshold:] - one_shot[threshold:]).abs().max() > 1e-3
    else:
        torch.testing.assert_close(got, one_shot, atol=ATOL, rtol=RTOL)


def test_trt_lowered_graph_equals_torch(tmp_path):
    """`--lower-for trt` on Phi-4-mini's shape (longrope, partial rotary): the graph, run by
    onnx.reference with plugins/reference_ops.py for TensorRT's ops, equals the torch module
    over a prefill below the switch, a decode onto it and a 3-token step past it."""
    from onnx.reference import ReferenceEvaluator

    from tests.test_plugins_trt_graphs import steps_match_torch
    from trt_spec.export.onnx_export import export_target
    from trt_spec.plugins.lowering import lowering
    from trt_spec.plugins.reference_ops import REFERENCE_OPS

    model, config = load_target(make_hf(tmp_path / "hf", "phi4-mini"))
    with lowering("trt"):  # the target graph as `trt-spec export --lower-for trt` traces it
        proto = export_target(model)
    assert any(n.op_type == "TRT_Attention" for n in proto.graph.node)
    session = ReferenceEvaluator(proto, new_ops=REFERENCE_OPS)
    steps_match_torch(session, proto, model, config, [ids_of(36, seed=8), ids_of(36, seed=9)],
                      ((0, 30), (30, 2), (32, 3)), max_len=40, total=40)


# --- config.json spellings and refusals ---------------------------------------------------

LLAMA = dict(architectures=["LlamaForCausalLM"], vocab_size=64, hidden_size=32,
             intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
             num_key_value_heads=1, max_position_embeddings=256, rope_theta=5e5)
LLAMA3 = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 64}


def test_transformers_4_and_5_spellings_agree():
    """rope_scaling with `type` (transformers 4), with `rope_type`, and rope_parameters with
    rope_theta inside (transformers 5) give one config; no scaling is the plain RoPE."""
    v4 = config_from_hf({**LLAMA, "rope_scaling": {"type": "llama3", **LLAMA3}})
    v4b = config_from_hf({**LLAMA, "rope_scaling": {"rope_type": "llama3", **LLAMA3}})
    theta = LLAMA["rope_theta"]
    v5 = config_from_hf({**{k: v for k, v in LLAMA.items() if k != "rope_theta"},
                         "rope_parameters": {"rope_type": "llama3", "rope_theta": theta,
                                             **LLAMA3}})
    assert v4 == v4b == v5 and v4.rope_scaling.kind == "llama3" and v4.rope_theta == theta
    # Phi-3's older "su" (and its "yarn") name its longrope (Phi3Config)
    phi = hf_config_dict("phi3.5-mini")
    params = {k: v for k, v in phi["rope_parameters"].items() if k != "rope_type"}
    su = {**phi, "rope_scaling": {**params, "type": "su"}}
    del su["rope_parameters"]
    assert config_from_hf(su) == config_from_hf(phi)
    assert config_from_hf(phi).rope_scaling.kind == "longrope"
    plain = config_from_hf({**LLAMA, "rope_scaling": None})
    assert plain.rope_scaling.kind == "default" and plain.rotary_dim == 16


def test_yarn_attention_factor_and_dynamic_positions():
    yarn = config_from_hf({**LLAMA, "rope_scaling": {"type": "yarn", "factor": 4.0,
                                                      "original_max_position_embeddings": 64}})
    assert yarn.rope_scaling.attention_factor == pytest.approx(0.1 * np.log(4.0) + 1)
    cos, sin = rope_tables(yarn)
    assert float((cos**2 + sin**2).sqrt().max()) == pytest.approx(
        yarn.rope_scaling.attention_factor, rel=1e-6)
    # dynamic NTK grows the base past max_position_embeddings: the engine takes factor x it
    dynamic = config_from_hf({**LLAMA, "rope_scaling": {"type": "dynamic", "factor": 2.0}})
    assert dynamic.max_position_embeddings == 512
    assert dynamic.rope_scaling.original_max_position_embeddings == 256


def test_old_manifest_config_is_plain_rope():
    from trt_spec.runtime.config import ModelConfig

    old = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_layers=4,
               num_heads=4, num_kv_heads=2, head_dim=16, rope_theta=10000.0,
               max_position_embeddings=256)
    c = ModelConfig.from_dict(old)
    assert c.rope_scaling.kind == "default" and c.rotary_dim == 16
    phi = config_from_hf(hf_config_dict("phi4-mini"))
    assert ModelConfig.from_dict(phi.to_dict()) == phi and phi.rotary_dim == 48


@pytest.mark.parametrize("change,match", [
    ({"rope_scaling": {"type": "mrope", "factor": 2.0}}, "rope_type 'mrope' is not supported"),
    ({"rope_scaling": {"type": "linear"}}, "'linear' has no 'factor'"),
    ({"rope_scaling": {"type": "longrope", "short_factor": [1.0] * 3, "long_factor": [1.0] * 8,
                       "original_max_position_embeddings": 64}},
     "short_factor has 3 entries; rotary dim 16 needs 8"),
    ({"partial_rotary_factor": 0.4375}, "partial_rotary_factor=0.4375 gives rotary dim 7"),
])
def test_refused_rope_configs_name_the_field(change, match):
    base = {**LLAMA, "partial_rotary_factor": 1.0}
    config_from_hf(base)
    with pytest.raises(ValueError, match=match):
        config_from_hf({**base, **change})


def test_phi3_fused_weights_map_in_order(tmp_path):
    """Phi-3's qkv_proj and gate_up_proj are the fused forms of ours (q, k, v rows; gate
    rows, then up); the loader takes them strictly."""
    folder = make_hf(tmp_path / "hf", "phi4-mini")
    model, config = load_target(folder)
    ref = hf_model(folder)
    assert config.family == "phi3" and config.tie_word_embeddings
    layer, theirs = model.layers[0], ref.model.layers[0]
    assert torch.equal(layer.qkv_proj.weight, theirs.self_attn.qkv_proj.weight)
    gate, up = layer.gate_up_proj.weight.chunk(2)
    assert torch.equal(torch.cat([gate, up]), theirs.mlp.gate_up_proj.weight)
