"""Drafter heads in the layouts they are published in (tests/random_drafters.py writes each one
exactly: key names, dtypes, config keys): every key mapped (the forward, written here from the
published formula, agrees), a missing or unexpected key fails with its name, the config keys
are read, what stays unsupported is refused by name, and speculative greedy output equals plain
greedy output on tiny targets (target_configs: each RoPE kind the target's reader takes)."""

import pytest

torch = pytest.importorskip("torch")

from tests.conftest import TINY_HF_CONFIG  # noqa: E402
from tests.random_drafters import (EAGLE3_HEADS, MTP_HEADS, published_eagle3,  # noqa: E402
                                   published_mtp, write_checkpoint)
from tests.test_drafter_formats import rope, run_torch  # noqa: E402
from trt_spec.export.checkpoint import config_from_hf, load_target  # noqa: E402
from trt_spec.export.drafter_checkpoint import load_drafter, save_drafter  # noqa: E402
from trt_spec.export.published_heads import target_rope  # noqa: E402

TOKENS = [5, 17, 99, 3, 42, 8]


@pytest.fixture(scope="module")
def target(tiny_hf_dir):
    model, _ = load_target(tiny_hf_dir)
    return model


def head_dir(tmp_path, target, layout, edit=None, **kwargs):
    """The head `layout` (an EAGLE3 or MTP flavour) written to a folder, after edit(W, cfg)."""
    make = published_eagle3 if layout in EAGLE3_HEADS else published_mtp
    W, cfg = make(target.config, 21, layout, **kwargs)
    if edit is not None:
        edit(W, cfg)
    return write_checkpoint(tmp_path / layout, W, cfg), W, cfg


def kind_of(layout):
    return "eagle3" if layout in EAGLE3_HEADS else "mtp"


# --- the published forwards, from the formulas (first step: positions 0..T-1) ---------------

def rms(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def decoder_layer(W, p, x, residual, cfg, bias=False, qk_norm=False, offset=0.0):
    """transformers' decoder layer after its input norm: x [T, in] -> the layer's output [T, H].
    offset 1.0: norms stored zero-centred."""
    eps, T = cfg["rms_norm_eps"], x.shape[0]
    heads, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]

    def proj(name, n):
        y = x @ W[p + f"self_attn.{name}_proj.weight"].T
        y = y + W[p + f"self_attn.{name}_proj.bias"] if bias else y
        y = y.view(T, n, -1)
        if qk_norm and name in "qk":
            y = rms(y, W[p + f"self_attn.{name}_norm.weight"] + offset, eps)
        return y.transpose(0, 1)  # (n, T, hd)

    q, k, v = proj("q", heads), proj("k", kv), proj("v", kv)
    theta = cfg.get("rope_theta", 10000.0)
    q, k = rope(q, theta), rope(k, theta)
    k, v = k.repeat_interleave(heads // kv, 0), v.repeat_interleave(heads // kv, 0)
    scores = (q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5).masked_fill(
        torch.ones(T, T).triu(1).bool(), float("-inf"))
    h = residual + (scores.softmax(-1) @ v).transpose(0, 1).reshape(T, -1) @ W[
        p + "self_attn.o_proj.weight"].T
    y = rms(h, W[p + "post_attention_layernorm.weight"] + offset, eps)
    return h + (torch.nn.functional.silu(y @ W[p + "mlp.gate_proj.weight"].T)
                * (y @ W[p + "mlp.up_proj.weight"].T)) @ W[p + "mlp.down_proj.weight"].T


def ref_eagle3(W, cfg, layout, embed, tokens, features):
    """EAGLE-3 as its trainers compute it; speculators nests the layer config and may norm
    the residual."""
    layer = cfg.get("transformer_layer_config", cfg)
    p = "midlayer." if "midlayer.input_layernorm.weight" in W else "layers.0."
    eps, nbr = layer["rms_norm_eps"], cfg.get("norm_before_residual", False)
    g = features @ W["fc.weight"].T + (W["fc.bias"] if "fc.bias" in W else 0)
    e = rms(embed[tokens], W[p + "input_layernorm.weight"], eps)
    n = rms(g, W[p + "hidden_norm.weight"], eps)
    h = decoder_layer(W, p, torch.cat([e, n], -1), n if nbr else g, {**cfg, **layer},
                      qk_norm=layout.endswith("qwen3"))
    return rms(h, W["norm.weight"], eps) @ W["lm_head.weight"].T


def ref_mtp(W, cfg, layout, target, tokens, hidden):
    """Module 0: DeepSeek-V3 ([e; h] into eh_proj, its shared_head), MiMo ([h; e] into
    input_proj, a Qwen2 layer, the target's head), Qwen3-Next (zero-centred norms, mtp.fc)."""
    eps, L = cfg["rms_norm_eps"], cfg["num_hidden_layers"]
    embed = target.embed_tokens.weight.detach().float()
    e = embed[tokens]
    if layout == "deepseek":
        p = f"model.layers.{L}."
        z = torch.cat([rms(e, W[p + "enorm.weight"], eps), rms(hidden, W[p + "hnorm.weight"], eps)],
                      -1) @ W[p + "eh_proj.weight"].T
        h = decoder_layer(W, p, rms(z, W[p + "input_layernorm.weight"], eps), z, cfg)
        return rms(h, W[p + "shared_head.norm.weight"], eps) @ W[p + "shared_head.head.weight"].T
    if layout == "mimo":
        p = "model.mtp_layers.0."
        z = torch.cat([rms(hidden, W[p + "hidden_layernorm.weight"], eps),
                       rms(e, W[p + "token_layernorm.weight"], eps)], -1)
        z = z @ W[p + "input_proj.weight"].T
        h = decoder_layer(W, p, rms(z, W[p + "input_layernorm.weight"], eps), z, cfg, bias=True)
        return rms(h, W[p + "final_layernorm.weight"], eps) @ embed.T
    p = "mtp.layers.0."
    z = torch.cat([rms(e, 1 + W["mtp.pre_fc_norm_embedding.weight"], eps),
                   rms(hidden, 1 + W["mtp.pre_fc_norm_hidden.weight"], eps)], -1)
    z = z @ W["mtp.fc.weight"].T
    h = decoder_layer(W, p, rms(z, 1 + W[p + "input_layernorm.weight"], eps), z, cfg,
                      qk_norm=True, offset=1.0)
    return rms(h, 1 + W["mtp.norm.weight"], eps) @ embed.T


@pytest.mark.parametrize("layout", EAGLE3_HEADS + MTP_HEADS)
def test_each_layout_maps_every_key(target, tmp_path, layout):
    folder, W, cfg = head_dir(tmp_path, target, layout)
    Wf = {k: v.float() if v.is_floating_point() else v for k, v in W.items()}
    drafter = load_drafter(folder, kind_of(layout), target)
    torch.manual_seed(0)
    if layout in EAGLE3_HEADS:
        features = torch.randn(len(TOKENS), 3 * target.config.hidden_size)
        embed = Wf.get("embed_tokens.weight", target.embed_tokens.weight.detach())
        want = ref_eagle3(Wf, cfg, layout, embed, TOKENS, features)
        with torch.no_grad():
            hidden = drafter.fc(features)
        assert drafter.d2t.tolist() == W["d2t"].tolist()
        ids = cfg.get("eagle_aux_hidden_state_layer_ids",
                      cfg.get("eagle_config", {}).get("eagle_aux_hidden_state_layer_ids"))
        assert drafter.feature_layers == tuple(ids or target.config.eagle3_layers)
        assert drafter.modules[0].norm_before_residual == (layout.startswith("speculators"))
    else:
        hidden = torch.randn(len(TOKENS), target.config.hidden_size)
        want = ref_mtp(Wf, cfg, layout, target, TOKENS, hidden)
        assert len(drafter.modules) == cfg["num_nextn_predict_layers"]
    (got, _), = run_torch(drafter.modules[0], [(TOKENS, hidden)])
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    # the own format keeps what the layout set (norm_before_residual, q/k norms, biases); it
    # stores no embedding (the target's: published heads ship a copy of it)
    save_drafter(drafter, tmp_path / "own")
    again = load_drafter(tmp_path / "own", kind_of(layout), target)
    for a, b in zip(drafter.modules, again.modules):
        assert getattr(a, "norm_before_residual", None) == getattr(b, "norm_before_residual", None)
        mine, theirs = a.state_dict(), b.state_dict()
        assert mine.keys() == theirs.keys()
        for key in mine.keys() - {"embed_tokens.weight"}:
            torch.testing.assert_close(theirs[key], mine[key].half().float(), msg=key)


LAYER_PREFIX = {"eagle": "midlayer.", "specforge": "midlayer.", "speculators": "layers.0.",
                "speculators-qwen3": "layers.0.", "deepseek": "model.layers.4.",
                "mimo": "model.mtp_layers.0.", "qwen3_next": "mtp.layers.0."}
OWN_KEY = {"eagle": "d2t", "specforge": "midlayer.hidden_norm.weight",
           "speculators": "layers.0.hidden_norm.weight",
           "speculators-qwen3": "layers.0.self_attn.q_norm.weight",
           "deepseek": "model.layers.5.eh_proj.weight",
           "mimo": "model.mtp_layers.0.input_proj.weight",
           "qwen3_next": "mtp.pre_fc_norm_hidden.weight"}


@pytest.mark.parametrize("layout", EAGLE3_HEADS + MTP_HEADS)
def test_a_missing_or_unexpected_key_is_named(target, tmp_path, layout):
    for key in (LAYER_PREFIX[layout] + "mlp.up_proj.weight", OWN_KEY[layout]):
        folder, _, _ = head_dir(tmp_path / "missing", target, layout,
                                lambda W, c, key=key: W.pop(key))
        with pytest.raises(KeyError, match="missing.*" + key.replace(".", r"\.")):
            load_drafter(folder, kind_of(layout), target)
    extra = LAYER_PREFIX[layout] + "mlp.extra.weight"
    folder, _, _ = head_dir(tmp_path / "extra", target, layout,
                            lambda W, c: W.__setitem__(extra, torch.zeros(2)))
    with pytest.raises(KeyError, match="unexpected.*" + extra.replace(".", r"\.")):
        load_drafter(folder, kind_of(layout), target)


def nested(cfg, **layer):
    cfg["transformer_layer_config"].update(layer)


@pytest.mark.parametrize("layout,edit,error,words", [
    ("speculators", lambda W, c: c.update(norm_before_fc=True), ValueError, ["norm_before_fc"]),
    ("speculators", lambda W, c: W.__setitem__("input_norm.weight", torch.ones(192)),
     ValueError, ["input_norm.weight"]),
    ("speculators", lambda W, c: c.update(speculators_model_type="eagle"), ValueError,
     ["speculators_model_type 'eagle'"]),
    ("speculators", lambda W, c: c.pop("norm_before_residual"), ValueError,
     ["norm_before_residual", "ambiguous"]),
    ("speculators", lambda W, c: nested(c, model_type="mistral"), ValueError,
     ["transformer_layer_config.model_type 'mistral'"]),
    ("speculators", lambda W, c: W.update({k.replace("layers.0.", "layers.1."): v.clone()
                                           for k, v in list(W.items())
                                           if k.startswith("layers.0.")}),
     ValueError, ["layers.1.", "one-layer"]),
    ("speculators", lambda W, c: c.update(target_hidden_size=96), ValueError,
     ["target_hidden_size 96", "64"]),
    ("speculators", lambda W, c: nested(c, mlp_bias=True), ValueError, ["mlp_bias"]),
    ("speculators", lambda W, c: c.update(draft_vocab_size=40), ValueError,
     ["lm_head.weight", "(48, 64)", "(40, 64)"]),
    ("speculators", lambda W, c: c.update(eagle_aux_hidden_state_layer_ids=[0, 9, 2]),
     ValueError, ["eagle_aux_hidden_state_layer_ids [0, 9, 2]"]),
    ("eagle", lambda W, c: c.update(num_key_value_heads=4), ValueError,
     ["midlayer.self_attn.k_proj.weight", "(32, 128)", "(64, 128)"]),
    ("qwen3_next", lambda W, c: c.update(partial_rotary_factor=0.25), ValueError,
     ["partial_rotary_factor 0.25"]),
    ("mimo", lambda W, c: c.update(num_hidden_layers=6), ValueError, ["num_hidden_layers 6"]),
    ("deepseek", lambda W, c: c.update(kv_lora_rank=512), ValueError, ["kv_lora_rank", "MLA"]),
])
def test_what_is_refused_is_named(target, tmp_path, layout, edit, error, words):
    folder, _, _ = head_dir(tmp_path, target, layout, edit)
    with pytest.raises(error) as e:
        load_drafter(folder, kind_of(layout), target)
    for word in words:
        assert word in str(e.value)


def test_the_real_qwen3_next_module_is_refused_by_name(target, tmp_path):
    """Qwen3-Next's MTP layer as published: partial RoPE, a gated q_proj, experts. Each is
    named; only a dense, ungated, full-rotary layer in this layout loads."""
    for edit, words in (
            (None, ["partial_rotary_factor 0.25"]),
            (lambda W, c: c.update(partial_rotary_factor=1.0),
             ["mtp.layers.0.self_attn.q_proj.weight", "gated attention"]),
            (lambda W, c: (c.update(partial_rotary_factor=1.0), W.__setitem__(
                "mtp.layers.0.self_attn.q_proj.weight", torch.zeros(64, 64))),
             ["mtp.layers.0.mlp.experts.*", "mixture of experts"])):
        folder, _, _ = head_dir(tmp_path, target, "qwen3_next", edit, gated=True)
        with pytest.raises(ValueError) as e:
            load_drafter(folder, "mtp", target)
        for word in words:
            assert word in str(e.value)


# --- RoPE: the head's stated settings, else its target's ------------------------------------

LLAMA3_ROPE = {"rope_theta": 500000.0, "rope_scaling": {
    "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32}}


def test_a_head_takes_the_rope_its_config_leaves_out_from_its_target(target, tmp_path):
    folder, _, _ = head_dir(tmp_path / "a", target, "eagle")  # no rope keys: the target's
    step = load_drafter(folder, "eagle3", target).modules[0]
    assert target_rope(step.config) == target_rope(target.config)
    torch.testing.assert_close(step.cos_cache, target.cos_cache)
    folder, _, _ = head_dir(tmp_path / "b", target, "specforge",
                            lambda W, c: c.update(rope_theta=500000.0))  # stated: its own
    step = load_drafter(folder, "eagle3", target).modules[0]
    assert step.config.rope_theta == 500000.0 != target.config.rope_theta


def test_a_head_states_its_rope_scaling_as_a_target_would(target, tmp_path):
    """A stated rope_scaling (speculators copies its verifier's) is read by the target's own
    reader: refused with the target's message where a target's would be, else the same RoPE."""
    as_target = {**TINY_HF_CONFIG, **LLAMA3_ROPE}
    folder, _, _ = head_dir(tmp_path, target, "speculators", rope=LLAMA3_ROPE)
    try:
        want = config_from_hf(as_target)
    except ValueError as e:
        with pytest.raises(ValueError, match="the head's layer: " + str(e).split(" (")[0]):
            load_drafter(folder, "eagle3", target)
        return
    step = load_drafter(folder, "eagle3", target).modules[0]
    assert target_rope(step.config) == target_rope(want)


# --- speculative greedy = plain greedy through exported engines ------------------------------

def target_configs():
    """The tiny target under each RoPE kind: a kind the target's reader refuses is skipped
    with its message (llama3 runs once the reader takes rope_scaling)."""
    for name, keys in (("default-rope", {}), ("llama3-rope", LLAMA3_ROPE)):
        yield pytest.param({**TINY_HF_CONFIG, **keys}, id=name)


GROUPS = {  # engine -> {method: head layout}: every layout drafts in one of them
    "eagle-deepseek-qwen3next": {"eagle3": "eagle", "mtp": "deepseek", "eagle": "qwen3_next"},
    "speculators-mimo": {"eagle3": "speculators", "mtp": "mimo"},
    "specforge": {"eagle3": "specforge"},
    "speculators-qwen3": {"eagle3": "speculators-qwen3"},
}
PROMPTS = [[5, 17, 99, 3, 17, 99], [42, 8, 77, 61, 23, 11, 90, 8, 77]]


@pytest.fixture(scope="module", params=list(target_configs()))
def tiny_target(request, tmp_path_factory):
    """A tiny random Llama whose config.json is `request.param` (conftest's, RoPE keys over)."""
    transformers = pytest.importorskip("transformers")
    from tests.tiny_tokenizer import save_tiny_tokenizer

    try:
        config_from_hf(request.param)
    except ValueError as e:
        pytest.skip(f"the target's reader refuses this RoPE: {e}")
    folder = tmp_path_factory.mktemp("target")
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**request.param)).save_pretrained(folder)
    save_tiny_tokenizer(folder, request.param["vocab_size"])
    return folder, request.param


@pytest.mark.parametrize("group", list(GROUPS))
def test_greedy_speculation_with_published_heads_equals_plain(tiny_target, tmp_path, group):
    from trt_spec.export.config import ExportConfig
    from trt_spec.export.pipeline import export_model
    from trt_spec.runtime.generator import Generator
    from trt_spec.runtime.sampling import SamplingParams
    from trt_spec.runtime.scheduler import generate_ids

    folder, hf = tiny_target
    target, _ = load_target(folder)
    rope_keys = {k: hf[k] for k in ("rope_theta", "rope_scaling") if k in hf}
    heads = {}
    for method, layout in GROUPS[group].items():
        kwargs = {"rope": rope_keys} if layout.startswith("speculators") else {}
        heads[method], _, cfg = head_dir(tmp_path / method, target, layout, **kwargs)
        if not {"rope_scaling", "rope_parameters"} & set(cfg):  # the target's RoPE, all of it
            module = load_drafter(heads[method], method, target).modules[0]
            torch.testing.assert_close(module.cos_cache, target.cos_cache, atol=0, rtol=0)
            torch.testing.assert_close(module.sin_cache, target.sin_cache, atol=0, rtol=0)
    engine = export_model(ExportConfig(str(folder), tmp_path / "engine", "fp32", drafters=heads,
                                       shipped_drafters=False))
    greedy = SamplingParams(max_tokens=16, ignore_eos=True)
    gen = Generator(engine, max_batch=2, fallback=False)
    plain = [s.output_ids for s in generate_ids(gen, PROMPTS, greedy)]
    for method in heads:
        streams = generate_ids(gen, PROMPTS, greedy, method, 3)
        assert [s.output_ids for s in streams] == plain, (group, method)
        assert all(s.stats.proposed_per_position[0] > 0 for s in streams), method  # it drafted
