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

