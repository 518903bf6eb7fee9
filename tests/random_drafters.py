"""Random drafter checkpoints for tests, in every layout the loaders read.

`published_*` write the key names and config.json of the published formats from a flat dict
of random tensors; `random_*` build the project's own Drafter objects."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import torch

from trt_spec.export.published_heads import build_mtp_module, layer_config, load_eagle3
from trt_spec.export.drafters import Drafter


def _randn(g: torch.Generator, *shape, scale: float = 0.2) -> torch.Tensor:
    return torch.randn(*shape, generator=g) * scale


def llama_layer(g, prefix: str, h: int, qkv_in: int, heads: int, kv_heads: int, head_dim: int,
                inter: int) -> dict[str, torch.Tensor]:
    return {
        prefix + "input_layernorm.weight": 1 + _randn(g, h, scale=0.1),
        prefix + "self_attn.q_proj.weight": _randn(g, heads * head_dim, qkv_in),
        prefix + "self_attn.k_proj.weight": _randn(g, kv_heads * head_dim, qkv_in),
        prefix + "self_attn.v_proj.weight": _randn(g, kv_heads * head_dim, qkv_in),
        prefix + "self_attn.o_proj.weight": _randn(g, h, heads * head_dim),
        prefix + "post_attention_layernorm.weight": 1 + _randn(g, h, scale=0.1),
        prefix + "mlp.gate_proj.weight": _randn(g, inter, h),
        prefix + "mlp.up_proj.weight": _randn(g, inter, h),
        prefix + "mlp.down_proj.weight": _randn(g, h, inter),
    }


def eagle3_tensors(target_config, seed: int, layout: str = "midlayer", draft_vocab: int = 48,
                   heads: int = 4, kv_heads: int = 2, inter: int = 96,
                   head_dim: int | None = None) -> tuple[dict, dict]:
    """(tensors, config.json) of a published EAGLE3 checkpoint for `target_config`; head_dim
    (default hidden / heads) is written to config.json as the Qwen3 heads do."""
    g = torch.Generator().manual_seed(seed)
    t = target_config
    h = t.hidden_size
    layer, fc, norm = (("midlayer.", "fc.", "norm.weight") if layout == "midlayer"
                       else ("model.layers.0.", "model.fc.", "model.norm.weight"))
    tensors = llama_layer(g, layer, h, 2 * h, heads, kv_heads, head_dim or h // heads, inter)
    tensors[layer + "hidden_norm.weight"] = 1 + _randn(g, h, scale=0.1)
    tensors[fc + "weight"] = _randn(g, h, 3 * h, scale=0.1)
    tensors[norm] = 1 + _randn(g, h, scale=0.1)
    tensors["lm_head.weight"] = _randn(g, draft_vocab, h)
    ids = torch.sort(torch.randperm(t.vocab_size, generator=g)[:draft_vocab]).values
    tensors["d2t"] = ids - torch.arange(draft_vocab)
    t2d = torch.zeros(t.vocab_size, dtype=torch.bool)
    t2d[ids] = True
    tensors["t2d"] = t2d
    config = {"architectures": ["LlamaForCausalLMEagle3"], "hidden_size": h,
              "num_attention_heads": heads, "num_key_value_heads": kv_heads,
              "intermediate_size": inter, "rms_norm_eps": 1e-5, "rope_theta": t.rope_theta,
              "vocab_size": t.vocab_size, "draft_vocab_size": draft_vocab,
              "target_hidden_size": h, "num_hidden_layers": 1, "hidden_act": "silu",
              "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(t.eagle3_layers)}}
    if head_dim:
        config["head_dim"] = head_dim
    return tensors, config


def mtp_tensors(target_config, seed: int, n: int = 2, shared_head: bool = True,
                inter: int = 96) -> tuple[dict, dict]:
    """(tensors, config.json) of DeepSeek-V3-style MTP layers model.layers.{L+i}."""
    g = torch.Generator().manual_seed(seed)
    t = target_config
    h, L = t.hidden_size, t.num_layers
    tensors = {}
    for i in range(n):
        p = f"model.layers.{L + i}."
        tensors.update(llama_layer(g, p, h, h, t.num_heads, t.num_kv_heads, t.head_dim, inter))
        tensors[p + "enorm.weight"] = 1 + _randn(g, h, scale=0.1)
        tensors[p + "hnorm.weight"] = 1 + _randn(g, h, scale=0.1)
        tensors[p + "eh_proj.weight"] = _randn(g, h, 2 * h)
        if shared_head:
            tensors[p + "shared_head.norm.weight"] = 1 + _randn(g, h, scale=0.1)
            tensors[p + "shared_head.head.weight"] = _randn(g, t.vocab_size, h)
    config = {"architectures": ["DeepseekV3ForCausalLM"], "hidden_size": h,
              "num_hidden_layers": L, "num_nextn_predict_layers": n,
              "num_attention_heads": t.num_heads, "num_key_value_heads": t.num_kv_heads,
              "head_dim": t.head_dim, "intermediate_size": inter, "rms_norm_eps": 1e-5,
              "rope_theta": t.rope_theta, "vocab_size": t.vocab_size, "hidden_act": "silu"}
    return tensors, config


def write_checkpoint(folder: Path, tensors: dict, config: dict, binary: bool = False) -> Path:
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    if binary:
        torch.save(tensors, folder / "pytorch_model.bin")
    else:
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    return folder


def random_mtp(target, n: int, seed: int, kind: str = "mtp") -> Drafter:
    """N random MTP modules that use the target's embedding, final norm and head."""
    tensors, hf = mtp_tensors(target.config, seed, n, shared_head=False)
    config = layer_config(hf, target.config)
    modules = []
    for i in range(n):
        p = f"model.layers.{target.config.num_layers + i}."
        own = {"enorm": tensors[p + "enorm.weight"], "hnorm": tensors[p + "hnorm.weight"],
               "eh_proj.weight": tensors[p + "eh_proj.weight"],
               "layer.input_layernorm": tensors[p + "input_layernorm.weight"],
               "layer.qkv_proj.weight": torch.cat([tensors[p + f"self_attn.{x}_proj.weight"]
                                                   for x in "qkv"]),
               "layer.o_proj.weight": tensors[p + "self_attn.o_proj.weight"],
               "layer.post_attention_layernorm": tensors[p + "post_attention_layernorm.weight"],
               "layer.gate_up_proj.weight": torch.cat([tensors[p + "mlp.gate_proj.weight"],
                                                       tensors[p + "mlp.up_proj.weight"]]),
               "layer.down_proj.weight": tensors[p + "mlp.down_proj.weight"]}
        modules.append(build_mtp_module(own, config, target, "random"))
    return Drafter(kind, modules)


def random_eagle3(target, seed: int, draft_vocab: int = 48) -> Drafter:
    with tempfile.TemporaryDirectory() as tmp:
        tensors, config = eagle3_tensors(target.config, seed, draft_vocab=draft_vocab)
        return load_eagle3(write_checkpoint(Path(tmp), tensors, config), target)



# --- the published layouts exactly: key names, dtypes, config keys (export/published_heads.py) ---

EAGLE3_HEADS = ("eagle", "specforge", "speculators", "speculators-qwen3")
MTP_HEADS = ("deepseek", "mimo", "qwen3_next")


def _cast(tensors: dict, dtype: torch.dtype) -> dict:
    return {k: v.to(dtype) if v.is_floating_point() else v for k, v in tensors.items()}


def published_eagle3(target_config, seed: int, flavour: str, rope: dict | None = None,
                     draft_vocab: int = 48) -> tuple[dict, dict]:
    """An EAGLE3 head as `flavour` publishes it. eagle: the EAGLE authors' (fp16, midlayer.*,
    no embedding, LlamaForCausalLMEagle3); specforge: SpecForge's (bf16, midlayer.* plus
    embed_tokens, head_dim and rope_* stated); speculators[-qwen3]: the speculators library's
    (bf16, layers.0.*, embed_tokens, config nested in transformer_layer_config with the
    target's rope keys `rope`, norm_before_residual true; the qwen3 layer has q/k norms)."""
    t = target_config
    g = torch.Generator().manual_seed(seed + 1000)
    tensors, config = eagle3_tensors(t, seed, draft_vocab=draft_vocab,
                                     head_dim=16 if flavour == "specforge" else None)
    if flavour == "eagle":
        config.update(torch_dtype="float16", bias=False, model_type="llama")
        return _cast(tensors, torch.float16), config
    tensors["embed_tokens.weight"] = _randn(g, t.vocab_size, t.hidden_size)
    if flavour == "specforge":
        config.pop("eagle_config")
        config.update(torch_dtype="bfloat16", model_type="llama", rope_scaling=None,
                      rope_theta=t.rope_theta, max_position_embeddings=t.max_position_embeddings,
                      attention_bias=False)
        return _cast(tensors, torch.bfloat16), config
    tensors = {k.replace("midlayer.", "layers.0."): v for k, v in tensors.items()}
    model_type = flavour.removeprefix("speculators").removeprefix("-") or "llama"
    if model_type == "qwen3":
        hd = t.hidden_size // config["num_attention_heads"]
        tensors["layers.0.self_attn.q_norm.weight"] = 1 + _randn(g, hd, scale=0.1)
        tensors["layers.0.self_attn.k_norm.weight"] = 1 + _randn(g, hd, scale=0.1)
    layer = {k: config[k] for k in ("hidden_size", "num_attention_heads", "num_key_value_heads",
                                    "intermediate_size", "rms_norm_eps", "vocab_size",
                                    "hidden_act")}
    layer.update(model_type=model_type, num_hidden_layers=1, **(rope or {}))
    config = {"architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3",
              "speculators_version": "0.2.0", "draft_vocab_size": draft_vocab,
              "norm_before_residual": True, "target_hidden_size": None,
              "eagle_aux_hidden_state_layer_ids": [0, 1, t.num_layers - 1],
              "torch_dtype": "bfloat16", "transformer_layer_config": layer,
              "speculators_config": {"algorithm": "eagle3", "default_proposal_method": "greedy",
                                     "proposal_methods": [{"proposal_type": "greedy",
                                                           "speculative_tokens": 3}],
                                     "verifier": {"architectures": ["LlamaForCausalLM"],
                                                  "name_or_path": "tiny-llama"}}}
    return _cast(tensors, torch.bfloat16), config


def qwen_layer(g, prefix: str, h: int, heads: int, kv_heads: int, head_dim: int, inter: int,
               biases: bool = False, qk_norm: bool = False, centre: float = 1.0) -> dict:
    """A Qwen2 (q/k/v biases) or Qwen3 (q/k norms) decoder layer; centre 0.0: zero-centred norms
    (Qwen3-Next stores w for x * (1 + w))."""
    out = llama_layer(g, prefix, h, h, heads, kv_heads, head_dim, inter)
    for norm in ("input_layernorm.weight", "post_attention_layernorm.weight"):
        out[prefix + norm] += centre - 1
    if biases:
        for x, n in (("q", heads), ("k", kv_heads), ("v", kv_heads)):
            out[prefix + f"self_attn.{x}_proj.bias"] = _randn(g, n * head_dim)
    if qk_norm:
        for x in "qk":
            out[prefix + f"self_attn.{x}_norm.weight"] = centre + _randn(g, head_dim, scale=0.1)
    return out


def published_mtp(target_config, seed: int, flavour: str, gated: bool = False
                  ) -> tuple[dict, dict]:
    """MTP modules as `flavour` publishes them, bf16. deepseek: model.layers.{L+i}.* (2
    modules, own shared_head); mimo: model.mtp_layers.0.*, a Qwen2 layer, with the target's
    embedding beside it as in the full MiMo checkpoint; qwen3_next: mtp.* (1 module, a dense,
    ungated, full-rotary Qwen3 layer, zero-centred norms) — gated=True: the real one (q_proj
    with an output gate, experts, partial_rotary_factor 0.25), which is refused."""
    t = target_config
    h, L, hd = t.hidden_size, t.num_layers, t.head_dim
    if flavour == "deepseek":
        tensors, config = mtp_tensors(t, seed, n=2)
        config.update(model_type="deepseek_v3", torch_dtype="bfloat16", first_k_dense_replace=3,
                      attention_bias=False)
        return _cast(tensors, torch.bfloat16), config
    g = torch.Generator().manual_seed(seed)
    base = {"hidden_size": h, "num_hidden_layers": L, "num_attention_heads": t.num_heads,
            "num_key_value_heads": t.num_kv_heads, "head_dim": hd, "intermediate_size": 96,
            "rms_norm_eps": 1e-6, "rope_theta": t.rope_theta, "vocab_size": t.vocab_size,
            "hidden_act": "silu", "torch_dtype": "bfloat16", "num_nextn_predict_layers": 1}
    if flavour == "mimo":
        p = "model.mtp_layers.0."
        tensors = qwen_layer(g, p, h, t.num_heads, t.num_kv_heads, hd, 96, biases=True)
        for norm in ("token_layernorm", "hidden_layernorm", "final_layernorm"):
            tensors[p + norm + ".weight"] = 1 + _randn(g, h, scale=0.1)
        tensors[p + "input_proj.weight"] = _randn(g, h, 2 * h)
        tensors["model.embed_tokens.weight"] = _randn(g, t.vocab_size, h)  # the target's
        config = {"architectures": ["MiMoForCausalLM"], "model_type": "mimo", **base,
                  "rope_scaling": None, "use_sliding_window": False, "max_window_layers": L,
                  "tie_word_embeddings": False}
        return _cast(tensors, torch.bfloat16), config
    assert flavour == "qwen3_next", flavour
    p = "mtp.layers.0."
    tensors = qwen_layer(g, p, h, t.num_heads, t.num_kv_heads, hd, 96, qk_norm=True, centre=0.0)
    for norm in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        tensors[f"mtp.{norm}.weight"] = _randn(g, h, scale=0.1)
    tensors["mtp.fc.weight"] = _randn(g, h, 2 * h)
    config = {"architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next", **base,
              "partial_rotary_factor": 1.0, "num_experts": 0, "attention_bias": False,
              "layer_types": ["linear_attention"] * (L - 1) + ["full_attention"]}
    if gated:
        tensors[p + "self_attn.q_proj.weight"] = _randn(g, 2 * t.num_heads * hd, h)
        for w in ("gate_proj", "up_proj", "down_proj"):
            dense = tensors.pop(p + f"mlp.{w}.weight")
            for e in range(2):
                tensors[p + f"mlp.experts.{e}.{w}.weight"] = dense.clone()
        tensors[p + "mlp.gate.weight"] = _randn(g, 2, h)
        config.update(partial_rotary_factor=0.25, num_experts=2, num_experts_per_tok=1)
    return _cast(tensors, torch.bfloat16), config
