"""Qwen2, Qwen3 and Gemma 3 through the shared decoder: tiny random models built in-process
with transformers, exported fp32 the way `trt-spec export` does, and compared with
transformers (logits, argmax by teacher forcing, greedy generation), plus every speculative
method lossless on them, and the sliding window's semantics in ORT's GroupQueryAttention."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from trt_spec.export.checkpoint import load_target  # noqa: E402
from trt_spec.export.model import empty_cache  # noqa: E402
from trt_spec.runtime.backends.ort import OrtTarget  # noqa: E402
from trt_spec.runtime.kv_cache import KVCache  # noqa: E402
from trt_spec.runtime.step_inputs import SlotTokens  # noqa: E402
from trt_spec.runtime.scheduler import generate_ids

COMMON = dict(vocab_size=192, hidden_size=64, intermediate_size=128, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.2,
              bos_token_id=1, eos_token_id=2, pad_token_id=0, rms_norm_eps=1e-6)
# One per family, each with what sets it apart; head_dim is a multiple of 16 (ORT's
# GroupQueryAttention with rotary requires it).
FAMILIES = {
    # q/k/v biases, an untied head, rope theta 1e6
    "qwen2": ("Qwen2ForCausalLM", "Qwen2Config",
              dict(num_hidden_layers=3, rope_theta=1e6, tie_word_embeddings=False)),
    # per-head q/k norms, head_dim 32 != hidden / heads = 16, tied head
    "qwen3": ("Qwen3ForCausalLM", "Qwen3Config",
              dict(num_hidden_layers=3, head_dim=32, rope_theta=1e6, tie_word_embeddings=True)),
    # (1 + w) norms, sqrt(H) embeddings, q/k norms, sandwich norms, GELU-tanh, a window of 8
    # on layers 0, 1, 3, 4 with rope base 1e4, full layers 2, 5 with 1e6, the attention
    # scale from query_pre_attn_scalar (24, not head_dim), final logit softcapping
    "gemma3": ("Gemma3ForCausalLM", "Gemma3TextConfig",
               dict(num_hidden_layers=6, num_key_value_heads=1, head_dim=32, sliding_window=8,
                    layer_types=["sliding_attention", "sliding_attention", "full_attention"] * 2,
                    rope_parameters={
                        "full_attention": {"rope_type": "default", "rope_theta": 1e6},
                        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}},
                    query_pre_attn_scalar=24, final_logit_softcapping=30.0,
                    hidden_activation="gelu_pytorch_tanh", tie_word_embeddings=True)),
}
NAMES = tuple(FAMILIES)


def make_family_hf(folder, family: str, seed: int = 0):
    """A random tiny model of `family`, saved as a Hugging Face folder with a tokenizer.
    Norm weights and biases (initialized to constants) get noise so the tests see them."""
    from tests.tiny_tokenizer import save_tiny_tokenizer

    arch, config_cls, extra = FAMILIES[family]
    torch.manual_seed(seed)
    config = getattr(transformers, config_cls)(**{**COMMON, **extra})
    model = getattr(transformers, arch)(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(folder)
    save_tiny_tokenizer(folder, COMMON["vocab_size"])
    return folder


@pytest.fixture(scope="module", params=NAMES)
def family_hf(request, tmp_path_factory):
    return request.param, make_family_hf(tmp_path_factory.mktemp(request.param), request.param)


@pytest.fixture(scope="module")
def family_engine(family_hf, tmp_path_factory):
    """The family's model exported fp32 for ORT, with a 1-layer self-draft and random MTP
    (2 modules), Eagle and Eagle3 heads (what `trt-spec export` does with those options)."""
    from tests.random_drafters import eagle3_tensors, random_mtp, write_checkpoint
    from trt_spec.export.drafter_checkpoint import save_drafter
    from trt_spec.export.config import ExportConfig
    from trt_spec.export.pipeline import export_model

    family, folder = family_hf
    root = tmp_path_factory.mktemp(f"{family}-heads")
    target, config = load_target(folder)
    save_drafter(random_mtp(target, 2, seed=11), root / "mtp")
    save_drafter(random_mtp(target, 1, seed=12, kind="eagle"), root / "eagle")
    if family == "qwen3":  # the published Qwen3 EAGLE-3 layout (qwen3_eagle3_hf)
        tensors, hf = qwen3_eagle3_hf(config)
    else:
        tensors, hf = eagle3_tensors(config, seed=13)
    write_checkpoint(root / "eagle3", tensors, hf)
    engine = export_model(ExportConfig(
        str(folder), tmp_path_factory.mktemp("engines") / family, "fp32", draft_layers=1,
        drafters={k: root / k for k in ("mtp", "eagle", "eagle3")}))
    return family, folder, engine


def qwen3_eagle3_hf(config) -> tuple[dict, dict]:
    """A random EAGLE-3 head as published for Qwen3 targets (e.g. AngelSlim's Qwen3 heads:
    LlamaForCausalLMEagle3, midlayer.* / fc / norm / lm_head / d2t / t2d keys, head_dim in
    config.json and not hidden / heads, rope_theta 1e6, no eagle_config: default layers)."""
    from tests.random_drafters import eagle3_tensors

    tensors, hf = eagle3_tensors(config, seed=13, head_dim=32)
    del hf["eagle_config"]
    hf.update({"model_type": "llama", "attention_bias": False, "rope_theta": 1e6,
               "rope_scaling": None, "max_position_embeddings": 256, "tie_word_embeddings": False,
               "use_sliding_window": False, "sliding_window": None, "rms_norm_eps": 1e-6,
               "torch_dtype": "bfloat16"})
    return tensors, hf


def test_qwen3_eagle3_layout_loads_strictly(family_hf, tmp_path):
    from tests.random_drafters import write_checkpoint
    from trt_spec.export.drafter_checkpoint import load_drafter

    family, folder = family_hf
    if family != "qwen3":
        pytest.skip("the Qwen3 layout is checked on the Qwen3 target")
    target, config = load_target(folder)
    tensors, hf = qwen3_eagle3_hf(config)
    drafter = load_drafter(write_checkpoint(tmp_path / "ok", tensors, hf), "eagle3", target)
    assert drafter.config.head_dim == 32 and drafter.config.rope_theta == 1e6
    assert drafter.feature_layers == config.eagle3_layers
    with pytest.raises(KeyError, match="unexpected checkpoint keys"):
        load_drafter(write_checkpoint(tmp_path / "extra", {**tensors, "midlayer.x": tensors["d2t"].clone()},
                                      hf), "eagle3", target)
    bad = dict(hf, head_dim=16)
    with pytest.raises(ValueError, match="shape"):
        load_drafter(write_checkpoint(tmp_path / "bad", tensors, bad), "eagle3", target)


def prompts(n: int, length: int, seed: int) -> list[list[int]]:
    g = np.random.default_rng(seed)
    return [g.integers(3, COMMON["vocab_size"], length).tolist() for _ in range(n)]


def hf_model(folder):
    return transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def test_config_flags(family_hf):
    family, folder = family_hf
    _, c = load_target(folder)
    assert c.family == family
    assert c.attention_bias == (family == "qwen2")
    assert c.qk_norm == (family != "qwen2")
    assert c.tie_word_embeddings == (family != "qwen2")
    if family == "gemma3":
        assert c.sandwich_norm and c.hidden_act == "gelu_tanh" and c.embed_scale == 8.0
        assert [c.layer_window(i) for i in range(6)] == [8, 8, 0, 8, 8, 0]
        assert (c.rope_theta, c.rope_local_theta, c.logit_softcap) == (1e6, 1e4, 30.0)
    else:
        assert c.head_dim == (32 if family == "qwen3" else 16) and not c.layer_types
    from trt_spec.runtime.config import ModelConfig
    assert ModelConfig.from_dict(c.to_dict()) == c


def test_torch_module_matches_transformers(family_hf):
    """One 40-token pass (5 windows of Gemma's 8) through the export module: logits, final
    hidden state and Eagle3 features equal transformers' on the same weights."""
    family, folder = family_hf
    model, config = load_target(folder)
    ids = torch.tensor(prompts(1, 40, seed=1))
    t = ids.shape[1]
    with torch.no_grad():
        expected = hf_model(folder)(ids, output_hidden_states=True)
        logits, hidden, features, *_ = model(
            ids, torch.arange(t)[None], torch.tensor([t - 1], dtype=torch.int32),
            torch.tensor([t], dtype=torch.int32), torch.tensor(64, dtype=torch.int32),
            torch.arange(t)[None], *empty_cache(config, 1, 64))
    torch.testing.assert_close(logits, expected.logits, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(hidden, expected.hidden_states[-1], atol=1e-4, rtol=1e-4)
    want = torch.cat([expected.hidden_states[i] for i in config.eagle3_layers], dim=-1)
    torch.testing.assert_close(features, want, atol=1e-4, rtol=1e-4)
    # the training forward (train/forward.py: batched, no cache) computes the same
    from trt_spec.train.forward import causal_forward

    with torch.no_grad():
        hidden2, features2 = causal_forward(model, ids, want_features=True)
    torch.testing.assert_close(hidden2, expected.hidden_states[-1], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(features2, want, atol=1e-4, rtol=1e-4)


def test_ort_teacher_forcing_matches_transformers(family_engine):
    """The exported fp32 graph by teacher forcing on 8 prompts x 64 tokens (a 16-token
    prefill, then 1- and 3-token steps, so the window slides in decode and verify steps
    too): logits close to transformers' and the argmax equal at every position."""
    family, folder, engine = family_engine
    _, config = load_target(folder)
    ref = hf_model(folder)
    target = OrtTarget(engine / "target.onnx", config.num_layers, config.max_position_embeddings)
    cache = KVCache(config, slots=8, max_len=80)
    seqs = prompts(8, 64, seed=2)
    slots = [cache.allocate() for _ in seqs]
    got = [[] for _ in seqs]
    start = 0
    for n in [16] + [1, 3] * 12:
        out = target.step(cache, [SlotTokens(s, q[start:start + n], list(range(n)))
                                  for s, q in zip(slots, seqs)])
        for i in range(len(seqs)):
            got[i].append(out.logits[i][:n])
        start += n
    assert start == 64
    with torch.no_grad():
        expected = ref(torch.tensor(seqs)).logits.numpy()  # (8, 64, V)
    got = np.stack([np.concatenate(g) for g in got])
    np.testing.assert_allclose(got, expected, atol=2e-4, rtol=1e-4)
    assert (got.argmax(-1) == expected.argmax(-1)).all()


def greedy_reference(model, prompt: list[int], n: int) -> list[int]:
    """Greedy decoding by full forwards (no cache): the argmax after each prefix."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


def test_runtime_greedy_equals_transformers(family_engine):
    """Greedy generation with the runtime (prompts of 12 tokens, 24 new: past Gemma's window)
    equals transformers' greedy."""
    from trt_spec.runtime.generator import Generator
    from trt_spec.runtime.sampling import SamplingParams

    family, folder, engine = family_engine
    ref = hf_model(folder)
    ps = prompts(3, 12, seed=3)
    gen = Generator(engine, max_batch=3)
    streams = generate_ids(gen, ps, SamplingParams(max_tokens=24, ignore_eos=True))
    assert [s.output_ids for s in streams] == [greedy_reference(ref, p, 24) for p in ps]


@pytest.mark.parametrize("method", ["ngram", "vanilla", "mtp", "eagle", "eagle3"])
def test_greedy_speculative_equals_plain(family_engine, method):
    """Every method, over random heads and a 1-layer self-draft, reproduces plain greedy."""
    from trt_spec.runtime.generator import Generator
    from trt_spec.runtime.settings import SpeculationConfig
    from trt_spec.runtime.sampling import SamplingParams

    family, folder, engine = family_engine
    ps = prompts(3, 10, seed=4)
    ps[0] = ps[0][:5] * 2  # a repeat, so n-gram drafts something
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    plain = [s.output_ids for s in generate_ids(Generator(engine, max_batch=3), ps, params)]
    gen = Generator(engine, method=method, max_batch=3,
                    speculation=SpeculationConfig(num_draft_tokens=3))
    streams = generate_ids(gen, ps, params)
    assert [s.output_ids for s in streams] == plain
    if method != "ngram":
        assert sum(s.stats.proposed for s in streams) > 0


# --- the sliding window in ORT's GroupQueryAttention against the reference -------------

def gqa_session(window: int | None, num_heads: int, kv_heads: int, head_dim: int, max_len: int,
                folder):
    """One GroupQueryAttention node, opened as the runtime opens graphs (make_session: the
    process's shared thread pool)."""
    import onnx
    from onnx import TensorProto as TP
    from onnx import helper

    from trt_spec.runtime.backends.ort import make_session

    shapes = [("qkv", TP.FLOAT, [1, "T", (num_heads + 2 * kv_heads) * head_dim]),
              ("past_key", TP.FLOAT, [1, kv_heads, max_len, head_dim]),
              ("past_value", TP.FLOAT, [1, kv_heads, max_len, head_dim]),
              ("seqlens_k", TP.INT32, [1]), ("total", TP.INT32, []),
              ("cos", TP.FLOAT, [max_len, head_dim // 2]), ("sin", TP.FLOAT, [max_len, head_dim // 2]),
              ("position_ids", TP.INT64, [1, "T"])]
    attrs = dict(num_heads=num_heads, kv_num_heads=kv_heads, do_rotary=1, rotary_interleaved=0)
    if window is not None:
        attrs["local_window_size"] = window
    node = helper.make_node("GroupQueryAttention", ["qkv", "", "", "past_key", "past_value",
                                                    "seqlens_k", "total", "cos", "sin",
                                                    "position_ids"],
                            ["out", "present_key", "present_value"], domain="com.microsoft",
                            **attrs)
    graph = helper.make_graph([node], "gqa", [helper.make_tensor_value_info(*s) for s in shapes],
                              [helper.make_tensor_value_info(n, TP.FLOAT, None)
                               for n in ("out", "present_key", "present_value")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                    helper.make_opsetid("com.microsoft", 1)])
    path = folder / f"gqa-{window}.onnx"
    onnx.save(model, str(path))
    return make_session(path)


@pytest.mark.parametrize("new_tokens", [20, 1, 3])
def test_gqa_local_window_size_counts_like_transformers(new_tokens, tmp_path):
    """local_window_size = W keeps keys j with i - j < W (transformers' sliding window: key j
    visible from query i when j > i - W), at prefill and in 1- and 3-token steps after a past;
    W - 1 and W + 1 differ. The reference's `window` is that rule."""
    from trt_spec.export.model import rope_tables
    from trt_spec.plugins.attention import Heads, attention_reference
    from trt_spec.runtime.config import ModelConfig

    nh, kvh, hd, max_len, total, window = 2, 1, 16, 32, 20, 5
    cfg = ModelConfig(vocab_size=8, hidden_size=32, intermediate_size=8, num_layers=1,
                      num_heads=nh, num_kv_heads=kvh, head_dim=hd, max_position_embeddings=max_len)
    cos, sin = rope_tables(cfg)
    qkv = torch.randn(1, total, (nh + 2 * kvh) * hd, generator=torch.Generator().manual_seed(0))
    zeros = torch.zeros(1, kvh, max_len, hd)
    args = (torch.tensor([total - 1], dtype=torch.int32),)
    expected = {w: attention_reference(qkv, zeros, zeros, *args, torch.tensor([total], dtype=torch.int32),
                                       torch.arange(total)[None], cos, sin,
                                       Heads(nh, kvh, w))[0][:, total - new_tokens:].numpy()
                for w in (window - 1, window, window + 1)}
    # transformers' mask for the same sizes: the reference's rule
    from transformers.masking_utils import sliding_window_overlay
    rule = sliding_window_overlay(window)
    assert all(bool(rule(0, 0, i, j)) == (i - j < window)
               for i in range(total) for j in range(i + 1))

    past = total - new_tokens
    feeds = dict(qkv=qkv.numpy(), past_key=zeros.numpy(), past_value=zeros.numpy(),
                 cos=cos.numpy(), sin=sin.numpy())
    if past:  # cache the first `past` tokens' keys and values
        _, pk, pv = gqa_session(window, nh, kvh, hd, max_len, tmp_path).run(None, dict(
            feeds, qkv=qkv[:, :past].numpy(), seqlens_k=np.array([past - 1], np.int32),
            total=np.array(past, np.int32), position_ids=np.arange(past)[None]))
        feeds.update(past_key=pk, past_value=pv)
    step = dict(feeds, qkv=qkv[:, past:].numpy(), seqlens_k=np.array([total - 1], np.int32),
                total=np.array(total, np.int32), position_ids=np.arange(past, total)[None])
    got = gqa_session(window, nh, kvh, hd, max_len, tmp_path).run(["out"], step)[0]
    np.testing.assert_allclose(got, expected[window], atol=1e-5)
    for other in (window - 1, window + 1):
        assert np.abs(got - expected[other]).max() > 1e-3


def test_torch_cuda_backend_every_method_equals_ort(family_engine):
    """The torch-cuda backend (on the CPU, every step through its padded buckets) runs the
    same modules with its in-place attention (window included): greedy output equal to the
    ORT graphs' for every method."""
    from trt_spec.export.torch_backend import TorchGraphs
    from trt_spec.runtime.generator import Generator
    from trt_spec.runtime.manifest import load_manifest
    from trt_spec.runtime.sampling import SamplingParams

    family, folder, engine = family_engine
    ps = prompts(2, 12, seed=5)
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    plain = [s.output_ids for s in generate_ids(Generator(engine, max_batch=2), ps, params)]
    manifest = load_manifest(engine)
    graphs = TorchGraphs.from_manifest(manifest, device="cpu", cuda_graphs=False, pad=True)
    gen = Generator.from_graphs(manifest, graphs, max_batch=2, max_len=64)
    for method in ("none", "ngram", "vanilla", "mtp", "eagle", "eagle3"):
        streams = generate_ids(gen, ps, params, method, None if method == "none" else 3)
        assert [s.output_ids for s in streams] == plain, method


def test_trt_lowered_gemma3_graph_equals_torch(tmp_path_factory):
    """`--backend trt`: the sliding layers' window becomes a mask for TRT_Attention. The graph,
    run by onnx.reference with plugins/reference_ops.py standing in for TensorRT, equals the
    torch module over a prefill past the window, a decode and a 3-token verification."""
    from tests.test_plugins_trt_graphs import graph, steps_match_torch
    from trt_spec.export.config import ExportConfig
    from trt_spec.export.pipeline import export_model

    folder = make_family_hf(tmp_path_factory.mktemp("gemma3-trt"), "gemma3")
    engine = export_model(ExportConfig(str(folder),
                                       tmp_path_factory.mktemp("engines") / "gemma3-trt",
                                       "fp32", lower_for="trt"))
    model, config = load_target(folder)
    proto, session = graph(engine, "target")
    masked = [n for n in proto.graph.node if n.op_type == "TRT_Attention"
              and any(a.name == "causal_kind" and a.s == b"none" for a in n.attribute)]
    assert len(masked) == 4  # the sliding layers
    steps_match_torch(session, proto, model, config, prompts(2, 16, seed=6),
                      ((0, 12), (12, 1), (13, 3)), max_len=24)


def test_model_config_without_family_fields_is_llama():
    """A manifest written before the family options loads, as the Llama decoder it was."""
    from trt_spec.runtime.config import ModelConfig

    old = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_layers=4, num_heads=4,
               num_kv_heads=2, head_dim=16, rms_norm_eps=1e-5, rope_theta=10000.0,
               max_position_embeddings=256, tie_word_embeddings=True, bos_token_id=1,
               eos_token_ids=[2], eagle3_layers=[1, 2, 3])
    c = ModelConfig.from_dict(old)
    assert (c.family, c.qk_norm, c.sandwich_norm, c.sliding_window, c.layer_types) == \
        ("llama", False, False, 0, ())
    assert all(c.layer_window(i) == 0 for i in range(4))
    assert ModelConfig.from_dict(c.to_dict()) == c
    with pytest.raises(ValueError, match="layer_types has 2 entries for 4 layers"):
        ModelConfig.from_dict({**old, "layer_types": ["full_attention"] * 2})
    with pytest.raises(ValueError, match="need sliding_window > 0"):
        ModelConfig.from_dict({**old, "layer_types": ["sliding_attention"] * 4})


@pytest.mark.parametrize("change,match", [
    ({"architectures": ["Gemma2ForCausalLM"]}, "architecture 'Gemma2ForCausalLM' is not supported"),
    ({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping"),
    ({"rope_parameters": {"full_attention": {"rope_type": "linear", "factor": 8.0},
                          "sliding_attention": {"rope_type": "default"}}}, "rope scaling 'linear'"),
    ({"hidden_activation": "relu"}, "hidden activation 'relu'"),
])
def test_unsupported_gemma_configs_are_refused(change, match):
    from trt_spec.export.checkpoint import config_from_hf

    hf = dict(architectures=["Gemma3ForCausalLM"], vocab_size=64, hidden_size=32,
              intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
              num_key_value_heads=1, head_dim=16, sliding_window=4,
              layer_types=["sliding_attention", "full_attention"])
    config_from_hf(hf)  # the base is fine
    with pytest.raises(ValueError, match=match):
        config_from_hf({**hf, **change})


def test_older_qwen_configs_sliding_flag():
    """Qwen2.5 config.json files on the hub carry sliding_window (e.g. 32768) with
    use_sliding_window false and no layer_types: no window. With the flag, layers from
    max_window_layers on slide, as transformers builds them."""
    from trt_spec.export.checkpoint import config_from_hf

    hf = dict(architectures=["Qwen2ForCausalLM"], vocab_size=64, hidden_size=32,
              intermediate_size=64, num_hidden_layers=4, num_attention_heads=2,
              num_key_value_heads=1, sliding_window=32768, max_window_layers=2,
              use_sliding_window=False)
    c = config_from_hf(hf)
    assert (c.sliding_window, c.layer_types) == (0, ())
    c = config_from_hf({**hf, "use_sliding_window": True, "sliding_window": 16})
    assert [c.layer_window(i) for i in range(4)] == [0, 0, 16, 16]
    t = transformers.Qwen2Config(**{**{k: v for k, v in hf.items() if k != "architectures"},
                                    "use_sliding_window": True, "sliding_window": 16})
    assert list(c.layer_types) == list(t.layer_types)
