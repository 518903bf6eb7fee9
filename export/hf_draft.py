"""Our vanilla draft (project format: its layers and final norm, the target's embedding and
head) as a Hugging Face LlamaForCausalLM folder, for transformers' assisted generation.

The key map is the inverse of checkpoint.target_state_dict: fused qkv_proj / gate_up_proj are
split back into q/k/v and gate/up.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from trt_spec.export.checkpoint import load_target
from trt_spec.export.drafter_checkpoint import load_draft
from trt_spec.export.model import TargetModel
from trt_spec.runtime.files import atomic_folder, source_stamp


def hf_state_dict(draft: TargetModel) -> dict[str, torch.Tensor]:
    """TargetModel keys -> transformers Llama keys (fp32, contiguous)."""
    c = draft.config
    if c.family != "llama":  # the inverse of the Qwen / Gemma weight maps is not written
        raise ValueError(f"a {c.family} draft cannot be written as a Hugging Face folder yet "
                         "(only the Llama layout)")
    state = {k: v.detach().float() for k, v in draft.state_dict().items()
             if not k.endswith(("cos_cache", "sin_cache"))}
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    out = {"model.embed_tokens.weight": state.pop("embed_tokens.weight"),
           "model.norm.weight": state.pop("norm")}
    for i in range(c.num_layers):
        p, o = f"layers.{i}.", f"model.layers.{i}."
        out[o + "input_layernorm.weight"] = state.pop(p + "input_layernorm")
        out[o + "post_attention_layernorm.weight"] = state.pop(p + "post_attention_layernorm")
        wq, wk, wv = state.pop(p + "qkv_proj.weight").split([q, kv, kv], dim=0)
        out[o + "self_attn.q_proj.weight"] = wq
        out[o + "self_attn.k_proj.weight"] = wk
        out[o + "self_attn.v_proj.weight"] = wv
        out[o + "self_attn.o_proj.weight"] = state.pop(p + "o_proj.weight")
        gate, up = state.pop(p + "gate_up_proj.weight").split(c.intermediate_size, dim=0)
        out[o + "mlp.gate_proj.weight"] = gate
        out[o + "mlp.up_proj.weight"] = up
        out[o + "mlp.down_proj.weight"] = state.pop(p + "down_proj.weight")
    if not c.tie_word_embeddings:
        out["lm_head.weight"] = state.pop("lm_head.weight")
    assert not state, f"unmapped draft keys: {sorted(state)}"
    return {k: v.contiguous().clone() for k, v in out.items()}


def draft_to_hf(target_hf_dir: str | Path, draft_dir: str | Path, out: str | Path) -> Path:
    """Writes the draft as an HF folder at `out` (atomically: a temporary folder renamed), or
    returns `out` untouched when it was already made from the same target and draft."""
    from transformers import AutoConfig, AutoModelForCausalLM

    target_hf_dir, draft_dir, out = Path(target_hf_dir), Path(draft_dir), Path(out)
    stamp = source_stamp(target_hf_dir, draft_dir)
    done = out / "trt_spec_source.json"
    if done.is_file() and json.loads(done.read_text()) == stamp:
        return out
    target, _ = load_target(target_hf_dir)
    draft = load_draft(draft_dir, target)
    hf_config = AutoConfig.from_pretrained(target_hf_dir)
    hf_config.num_hidden_layers = draft.config.num_layers
    for key in ("layer_types",):  # per-layer lists sized for the target's depth
        if isinstance(getattr(hf_config, key, None), list):
            setattr(hf_config, key, getattr(hf_config, key)[:draft.config.num_layers])
    model = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32).eval()
    missing, unexpected = model.load_state_dict(hf_state_dict(draft), strict=False)
    # a tied head is no separate parameter to load; anything else missing is an error
    missing = [k for k in missing if not (k == "lm_head.weight" and hf_config.tie_word_embeddings)]
    if missing or unexpected:
        raise KeyError(f"{draft_dir} -> HF Llama: missing keys {missing[:8]}, "
                       f"unexpected keys {unexpected[:8]}")
    with atomic_folder(out) as tmp:
        model.save_pretrained(tmp)
        (tmp / "trt_spec_source.json").write_text(json.dumps(stamp, indent=2) + "\n")
    return out
