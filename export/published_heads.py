"""Drafter heads as they are published: each layout's tensor names and config.json keys, read
strictly onto export/drafters.py's modules; what stays unsupported is refused by its key or
field.

EAGLE3: one decoder layer over [input_layernorm(embed(x)); hidden_norm(g)] with g = fc(three
target layers' features), a head over a draft vocabulary (target id = draft id + d2t[draft id]).

    layout       tensors                                  config.json
    midlayer     midlayer.*, fc.weight, norm.weight,      draft_vocab_size, target_hidden_size,
                 lm_head.weight, d2t, t2d (EAGLE's        bias (an fc bias), eagle_config.
                 fp16; SpecForge: bf16 + embed_tokens)    eagle_aux_hidden_state_layer_ids
    model        model.layers.0.*, model.fc.*, model.norm.weight, model.embed_tokens.weight, ...
    speculators  layers.0.*, fc.weight (+ fc.bias),       speculators_model_type "eagle3",
                 norm.weight, lm_head.weight,             transformer_layer_config (the layer:
                 embed_tokens.weight, d2t, t2d            llama or qwen3), draft_vocab_size,
                                                          norm_before_residual, target_hidden_size,
                                                          eagle_aux_hidden_state_layer_ids

MTP: module i reads eh_proj([enorm(embed(x)); hnorm(h)]) into one decoder layer, then its norm
and head (the target's embedding and head where the module has none).

    deepseek     model.layers.{L+i}.{enorm, hnorm, eh_proj, shared_head.norm, shared_head.head,
                 embed_tokens, <Llama layer>}; num_nextn_predict_layers, num_hidden_layers = L
    mimo         model.mtp_layers.{i}.{token_layernorm, hidden_layernorm, input_proj,
                 final_layernorm, <Qwen2 layer: q/k/v biases>}; input_proj reads [h; e], so its
                 halves are swapped
    qwen3_next   mtp.{pre_fc_norm_embedding, pre_fc_norm_hidden, fc, norm} shared by the modules,
                 mtp.layers.{i}.<Qwen3 layer>; every norm zero-centred (x * (1 + w)). Its gated
                 attention, partial RoPE and experts are refused: only a dense, ungated,
                 full-rotary layer in this layout loads.

A head's decoder layer is read as a one-layer target of its family by the target's own reader
(checkpoint.config_from_hf), so a field is refused with the same message. Its RoPE is what its
config states (rope_scaling / rope_parameters, rope_theta); what it leaves out is its target's,
whose positions it was trained on. A full checkpoint (DeepSeek-V3, MiMo, Qwen3-Next) holds the
target's own weights beside its MTP layers: they are skipped.
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import torch

from trt_spec.export.checkpoint import StrictState, config_from_hf, load_into
from trt_spec.export.drafters import Drafter, Eagle3Fc, Eagle3Step, MTPModule
from trt_spec.export.model import TargetModel
from trt_spec.runtime.config import ModelConfig
from trt_spec.runtime.methods import METHODS


def read_tensors(folder: Path) -> dict[str, torch.Tensor]:
    """model.safetensors (or every *.safetensors shard), else pytorch_model.bin."""
    shards = sorted(folder.glob("*.safetensors"))
    if shards:
        from safetensors.torch import load_file

        out = {}
        for shard in shards:
            out.update(load_file(str(shard)))
        return out
    binary = folder / "pytorch_model.bin"
    if binary.exists():
        return torch.load(binary, map_location="cpu", weights_only=True)
    raise FileNotFoundError(f"{folder}: no model.safetensors, *.safetensors or pytorch_model.bin")


def read_config(folder: Path, name: str = "config.json") -> dict:
    path = folder / name
    if not path.exists():
        raise FileNotFoundError(f"{folder}: no {name}")
    return json.loads(path.read_text())


# --- the one decoder layer -------------------------------------------------------------------

ROPE_STATED = ("rope_scaling", "rope_parameters")  # stated, even null: the head's own RoPE
# target-wide fields a head's one full-attention layer does not take from its own config
NOT_THE_LAYERS = ("layer_types", "sliding_window", "use_sliding_window", "max_window_layers")


def target_rope(target: ModelConfig, hf: dict | None = None) -> dict:
    """The target's RoPE fields (every rope_* but the sliding layers' base, and its rotary
    share unless the head's config states its own)."""
    fields = {f.name: getattr(target, f.name) for f in dataclasses.fields(ModelConfig)
              if f.name.startswith("rope_") and f.name != "rope_local_theta"}
    if "partial_rotary_factor" not in (hf or {}):
        fields["partial_rotary_factor"] = target.partial_rotary_factor
    return fields


def layer_config(hf: dict, target: ModelConfig, architecture: str = "LlamaForCausalLM",
                 source: str = "drafter") -> ModelConfig:
    """The one decoder layer of a drafter from its config.json (transformers' names), read as a
    one-layer `architecture` (its family: Llama, Qwen2's q/k/v biases, Qwen3's q/k norms). What
    the config leaves out is the target's: width, heads, eps, RoPE."""
    for key in ("kv_lora_rank", "q_lora_rank"):
        if hf.get(key):
            raise ValueError(f"{source}: config has {key}={hf[key]}: MLA attention layers are "
                             "not supported; only Llama-style (GQA) drafter layers")
    t = target
    vocab = hf.get("vocab_size") or t.vocab_size
    if vocab != t.vocab_size:
        raise ValueError(f"{source}: drafter vocab_size {vocab} != the target's {t.vocab_size}: "
                         "a drafter must share the target's vocabulary")
    own = {k: v for k, v in hf.items()
           if k not in NOT_THE_LAYERS and (v is not None or k in ROPE_STATED)}
    layer = {"vocab_size": t.vocab_size, "hidden_size": t.hidden_size,
             "intermediate_size": t.intermediate_size, "num_attention_heads": t.num_heads,
             "rms_norm_eps": t.rms_norm_eps, "rope_theta": t.rope_theta, **own,
             "architectures": [architecture], "num_hidden_layers": 1,
             "tie_word_embeddings": False,  # positions run as far as the target's:
             "max_position_embeddings": t.max_position_embeddings}  # RoPE kinds may read it
    try:
        parsed = config_from_hf(layer)
    except ValueError as e:
        raise ValueError(f"{source}: the head's layer: {e}") from e
    rope = {} if any(k in hf for k in ROPE_STATED) else {**target_rope(t, hf),
                                                          "rope_theta": parsed.rope_theta}
    return dataclasses.replace(parsed, bos_token_id=None, eos_token_ids=(), eagle3_layers=(0,),
                               **rope)


def take_layer(state: StrictState, prefix: str, c: ModelConfig, qkv_in: int,
               norm_offset: float = 0.0) -> dict:
    """A decoder layer's keys under `prefix` -> DecoderLayer's (q/k/v and gate/up fused; q/k/v
    biases when c.attention_bias, q/k norms when c.qk_norm). norm_offset: 1.0 where the norms
    hold w for x * (1 + w) (Qwen3-Next)."""
    h, hd = c.hidden_size, c.head_dim
    if state.has(prefix + "self_attn.kv_a_proj_with_mqa.weight"):
        raise ValueError(f"{state.source}: {prefix}self_attn is MLA; only Llama-style attention "
                         "drafter layers are supported")
    if any(k.startswith(prefix + "mlp.experts.") for k in state.tensors):
        raise ValueError(f"{state.source}: {prefix}mlp is a mixture of experts "
                         f"({prefix}mlp.experts.*); only dense drafter layers are supported")

    def norm(key: str, width: int) -> torch.Tensor:
        return state.take(prefix + key, (width,)).float() + norm_offset

    rows = {"q": c.num_heads * hd, "k": c.num_kv_heads * hd, "v": c.num_kv_heads * hd}
    out = {
        "layer.input_layernorm": norm("input_layernorm.weight", h),
        "layer.qkv_proj.weight": torch.cat([
            state.take(prefix + f"self_attn.{x}_proj.weight", (n, qkv_in)).float()
            for x, n in rows.items()]),
        "layer.o_proj.weight": state.take(prefix + "self_attn.o_proj.weight",
                                          (h, c.num_heads * hd)),
        "layer.post_attention_layernorm": norm("post_attention_layernorm.weight", h),
        "layer.gate_up_proj.weight": torch.cat([
            state.take(prefix + "mlp.gate_proj.weight", (c.intermediate_size, h)).float(),
            state.take(prefix + "mlp.up_proj.weight", (c.intermediate_size, h)).float()]),
        "layer.down_proj.weight": state.take(prefix + "mlp.down_proj.weight",
                                             (h, c.intermediate_size)),
    }
    if c.attention_bias:
        out["layer.qkv_proj.bias"] = torch.cat([
            state.take(prefix + f"self_attn.{x}_proj.bias", (n,)).float() for x, n in rows.items()])
    if c.qk_norm:
        out["layer.q_norm"] = norm("self_attn.q_norm.weight", hd)
        out["layer.k_norm"] = norm("self_attn.k_norm.weight", hd)
    return out


def target_head(target: TargetModel) -> torch.Tensor:
    return target.embed_tokens.weight if target.lm_head is None else target.lm_head.weight


def build_mtp_module(own: dict[str, torch.Tensor], config: ModelConfig, target: TargetModel,
                     source: str) -> MTPModule:
    """`own`: MTPModule keys; embed_tokens.weight, head_norm and lm_head.weight may be absent
    (then the target's embedding, final norm and head are used)."""
    t = target.config
    if config.hidden_size != t.hidden_size:
        raise ValueError(f"{source}: MTP hidden_size {config.hidden_size} != the target's "
                         f"{t.hidden_size} (the module reads the target's hidden state)")
    own = dict(own)
    for key in ("embed_tokens.weight", "lm_head.weight"):
        if key in own and own[key].shape[0] != t.vocab_size:
            raise ValueError(f"{source}: {key} has {own[key].shape[0]} rows; the target's "
                             f"vocabulary has {t.vocab_size}")
    embed = own.pop("embed_tokens.weight", None)
    own_head = own.pop("lm_head.weight", None)
    own.setdefault("head_norm", target.norm.detach().clone())
    embed = target.embed_tokens.weight.detach() if embed is None else embed
    head = target_head(target).detach() if own_head is None else own_head
    tied = torch.equal(embed, head)
    module = MTPModule(dataclasses.replace(config, tie_word_embeddings=tied))
    own["embed_tokens.weight"] = embed
    if not tied:
        own["lm_head.weight"] = head
    load_into(module, own, source)
    return module.eval()


# --- MTP: DeepSeek-V3, MiMo, Qwen3-Next --------------------------------------------------------

def mtp_count(hf: dict, state: StrictState, pattern: str, source: str) -> int:
    """How many MTP modules: num_nextn_predict_layers (or Qwen3-Next's mtp_num_hidden_layers),
    else the module indices the tensors hold (`pattern` captures one)."""
    n = hf.get("num_nextn_predict_layers", hf.get("mtp_num_hidden_layers"))
    if n is None:
        n = len({m.group(1) for k in state.tensors if (m := re.match(pattern, k))})
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"{source}/config.json: num_nextn_predict_layers={n!r}; an MTP "
                         "checkpoint needs an integer >= 1")
    return n


def deepseek_modules(state: StrictState, hf: dict, t: ModelConfig, source: str):
    """-> (layer config, [MTPModule keys] per module): model.layers.{L+i}.*"""
    layers = t.num_layers  # load_mtp checked the config's
    n = mtp_count(hf, state, r"model\.layers\.(\d+)\.eh_proj\.", source)
    if hf.get("n_routed_experts") and hf.get("first_k_dense_replace", 0) <= layers:
        raise ValueError(f"{source}: the MTP layers are mixture-of-experts layers "
                         f"(n_routed_experts={hf['n_routed_experts']}); only dense layers are "
                         "supported")
    config = layer_config(hf, t, source=source)
    h, modules = config.hidden_size, []
    for i in range(n):
        p = f"model.layers.{layers + i}."
        own = take_layer(state, p, config, h)
        own["enorm"] = state.take(p + "enorm.weight", (h,))
        own["hnorm"] = state.take(p + "hnorm.weight", (h,))
        own["eh_proj.weight"] = state.take(p + "eh_proj.weight", (h, 2 * h))
        for ours, theirs in (("head_norm", "shared_head.norm.weight"),
                             ("lm_head.weight", "shared_head.head.weight"),
                             ("embed_tokens.weight", "embed_tokens.weight")):
            if state.has(p + theirs):
                own[ours] = state.take(p + theirs)
        modules.append(own)
    return config, modules


def mimo_modules(state: StrictState, hf: dict, t: ModelConfig, source: str):
    """-> (layer config, [MTPModule keys] per module): model.mtp_layers.{i}.*, a Qwen2 layer;
    the embedding and head are the target's."""
    n = mtp_count(hf, state, r"model\.mtp_layers\.(\d+)\.", source)
    config = layer_config(hf, t, "Qwen2ForCausalLM", source)
    h, modules = config.hidden_size, []
    for i in range(n):
        p = f"model.mtp_layers.{i}."
        own = take_layer(state, p, config, h)
        own["enorm"] = state.take(p + "token_layernorm.weight", (h,))
        own["hnorm"] = state.take(p + "hidden_layernorm.weight", (h,))
        proj = state.take(p + "input_proj.weight", (h, 2 * h))  # its input: [hidden; embedding]
        own["eh_proj.weight"] = torch.cat([proj[:, h:], proj[:, :h]], dim=1)  # ours: [e; h]
        own["head_norm"] = state.take(p + "final_layernorm.weight", (h,))
        modules.append(own)
    return config, modules


def qwen3_next_modules(state: StrictState, hf: dict, t: ModelConfig, source: str):
    """-> (layer config, [MTPModule keys] per module): mtp.layers.{i}.* and the mtp.* norms and
    fc they share, zero-centred norms shifted to x * w."""
    partial = hf.get("partial_rotary_factor", 1.0)
    if partial != 1.0:
        raise ValueError(f"{source}: partial_rotary_factor {partial}: RoPE over part of each head "
                         "(Qwen3-Next) is not supported; only 1.0")
    n = mtp_count(hf, state, r"mtp\.layers\.(\d+)\.", source)
    config = layer_config(hf, t, "Qwen3ForCausalLM", source)
    h, gated = config.hidden_size, 2 * config.num_heads * config.head_dim
    shared = {"enorm": state.take("mtp.pre_fc_norm_embedding.weight", (h,)).float() + 1.0,
              "hnorm": state.take("mtp.pre_fc_norm_hidden.weight", (h,)).float() + 1.0,
              "eh_proj.weight": state.take("mtp.fc.weight", (h, 2 * h)),  # [e; h], as ours
              "head_norm": state.take("mtp.norm.weight", (h,)).float() + 1.0}
    modules = []
    for i in range(n):
        p = f"mtp.layers.{i}."
        q = state.tensors.get(p + "self_attn.q_proj.weight")
        if q is not None and q.shape[0] == gated:
            raise ValueError(f"{source}: {p}self_attn.q_proj.weight has {gated} rows (queries "
                             "and an output gate): gated attention is not supported")
        modules.append({**take_layer(state, p, config, h, norm_offset=1.0), **shared})
    return config, modules


MTP_LAYOUTS = {  # name -> (a key prefix only it has, its reader); DeepSeek's otherwise
    "mimo": ("model.mtp_layers.", mimo_modules),
    "qwen3_next": ("mtp.", qwen3_next_modules),
}


def target_keys(key: str, layers: int) -> bool:
    """The target's own weights, which a full checkpoint holds beside its MTP layers."""
    return (key in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight")
            or any(key.startswith(f"model.layers.{j}.") for j in range(layers)))


def load_mtp(folder: Path, target: TargetModel, kind: str = "mtp") -> Drafter:
    """MTP modules from `folder` (it may be the full target checkpoint), in the DeepSeek-V3,
    MiMo or Qwen3-Next layout. A looped kind (Eagle) takes module 0 only."""
    folder = Path(folder)
    hf, source, t = read_config(folder), str(folder), target.config
    state = StrictState(read_tensors(folder), source)
    layers = hf.get("num_hidden_layers", t.num_layers)
    if layers != t.num_layers:
        raise ValueError(f"{source}: num_hidden_layers {layers} != the target's {t.num_layers} "
                         "(an MTP checkpoint belongs to its target)")
    read = next((reader for prefix, reader in MTP_LAYOUTS.values()
                 if any(k.startswith(prefix) for k in state.tensors)), deepseek_modules)
    config, modules = read(state, hf, t, source)
    if METHODS[kind].looped:
        modules = modules[:1]
    drafter = Drafter(kind, [build_mtp_module(own, config, target, f"{source} module {i}")
                             for i, own in enumerate(modules)])
    state.skip([k for k in state.tensors if target_keys(k, layers)])
    state.finish()
    return drafter


# --- EAGLE3: EAGLE / SpecForge, vLLM's model.* and speculators' ----------------------------------

EAGLE3_LAYOUTS = {  # name -> (layer prefix, fc, final norm, head, embedding)
    "midlayer": ("midlayer.", "fc.", "norm.weight", "lm_head.weight", "embed_tokens.weight"),
    "model": ("model.layers.0.", "model.fc.", "model.norm.weight", "lm_head.weight",
              "model.embed_tokens.weight"),
    "speculators": ("layers.0.", "fc.", "norm.weight", "lm_head.weight", "embed_tokens.weight"),
}
SPECULATORS_TYPE = "eagle3"  # speculators' name of the format (its speculators_model_type)
SPECULATORS_LAYERS = {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM"}


def eagle3_config(raw: dict, source: str) -> tuple[dict, str]:
    """config.json -> (the head's config, flat, and the architecture its layer is read as).
    speculators nests the layer's config in transformer_layer_config; the others are flat
    Llama configs (LlamaForCausalLMEagle3)."""
    if "speculators_model_type" not in raw and "transformer_layer_config" not in raw:
        return raw, "LlamaForCausalLM"
    model_type = raw.get("speculators_model_type")
    if model_type != SPECULATORS_TYPE:
        raise ValueError(f"{source}/config.json: speculators_model_type {model_type!r}; the "
                         f"EAGLE3 reader reads {SPECULATORS_TYPE!r}")
    layer = raw.get("transformer_layer_config") or {}
    model_type = layer.get("model_type", "llama")
    if model_type not in SPECULATORS_LAYERS:
        raise ValueError(f"{source}/config.json: transformer_layer_config.model_type "
                         f"{model_type!r}; supported: {', '.join(SPECULATORS_LAYERS)}")
    if raw.get("norm_before_fc"):
        raise ValueError(f"{source}/config.json: norm_before_fc=true (an RMS norm over the "
                         "target's features before fc) is not supported")
    if "norm_before_residual" not in raw:  # vLLM reads its absence as true, speculators as false
        raise ValueError(f"{source}/config.json: a speculators config without "
                         "norm_before_residual is ambiguous; state true or false")
    flat = {k: v for k, v in raw.items() if k != "transformer_layer_config"}
    return {**flat, **layer}, SPECULATORS_LAYERS[model_type]


def eagle3_layer_ids(hf: dict, target: ModelConfig, source: str) -> tuple[int, ...]:
    ids = hf.get("eagle_aux_hidden_state_layer_ids")
    if ids is None:
        ids = (hf.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    if ids is None:
        return target.eagle3_layers
    ids = tuple(int(i) for i in ids)
    if len(ids) != 3 or any(not 0 <= i < target.num_layers for i in ids):
        raise ValueError(f"{source}: eagle_aux_hidden_state_layer_ids {list(ids)}: need three "
                         f"layer ids in 0..{target.num_layers - 1}")
    return ids


def eagle3_layout(state: StrictState, source: str) -> str:
    layout = next((name for name, keys in EAGLE3_LAYOUTS.items()
                   if state.has(keys[0] + "input_layernorm.weight")), None)
    if layout is None:
        raise KeyError(f"{source}: not an EAGLE3 checkpoint: expected 'midlayer.*', "
                       "'model.layers.0.*' or 'layers.0.*' keys")
    extra = sorted({m.group(0) for k in state.tensors
                    if (m := re.match(r"(model\.)?layers\.[1-9]\d*\.|midlayers?\.[1-9]", k))})
    if extra:
        raise ValueError(f"{source}: {extra[0]}* is a second decoder layer; only one-layer "
                         "EAGLE3 heads are supported")
    if state.has("input_norm.weight"):
        raise ValueError(f"{source}: input_norm.weight (norm_before_fc) is not supported")
    return layout


def load_eagle3(folder: Path, target: TargetModel) -> Drafter:
    folder = Path(folder)
    source, t = str(folder), target.config
    hf, architecture = eagle3_config(read_config(folder), source)
    config = layer_config(hf, t, architecture, source)
    h = config.hidden_size
    target_hidden = hf.get("target_hidden_size") or t.hidden_size
    if target_hidden != t.hidden_size:
        raise ValueError(f"{source}: target_hidden_size {target_hidden} != the target's "
                         f"hidden_size {t.hidden_size}")
    draft_vocab = hf.get("draft_vocab_size") or t.vocab_size
    state = StrictState(read_tensors(folder), source)
    layer, fc, norm, head, embed = EAGLE3_LAYOUTS[eagle3_layout(state, source)]
    features = 3 * t.hidden_size
    bias = state.has(fc + "bias") or bool(hf.get("fc_bias", hf.get("bias", False)))
    own = take_layer(state, layer, config, 2 * h)
    own["hidden_norm"] = state.take(layer + "hidden_norm.weight", (h,))
    own["head_norm"] = state.take(norm, (h,))
    own["lm_head.weight"] = state.take(head, (draft_vocab, h))
    if state.has(embed):
        own["embed_tokens.weight"] = state.take(embed, (t.vocab_size, h))
    elif h == t.hidden_size:
        own["embed_tokens.weight"] = target.embed_tokens.weight.detach()
    else:
        raise KeyError(f"{source}: checkpoint has no {embed!r}, and the target's embedding "
                       f"({t.hidden_size} wide) cannot stand in for a {h}-wide one")
    fc_state = {"fc.weight": state.take(fc + "weight", (h, features))}
    if bias:
        fc_state["fc.bias"] = state.take(fc + "bias", (h,))
    d2t = state.take("d2t", (draft_vocab,)).long()
    t2d = state.take("t2d", (t.vocab_size,)).bool() if state.has("t2d") else None
    check_vocab_map(d2t, t2d, t.vocab_size, source)
    state.finish()
    return build_eagle3(own, fc_state, d2t, config, draft_vocab, features, bias,
                        eagle3_layer_ids(hf, t, source), source,
                        bool(hf.get("norm_before_residual", False)))


def check_vocab_map(d2t: torch.Tensor, t2d: torch.Tensor | None, vocab: int, source: str) -> None:
    ids = torch.arange(len(d2t)) + d2t
    if ids.min() < 0 or ids.max() >= vocab:
        raise ValueError(f"{source}: d2t maps draft ids outside the target vocabulary "
                         f"0..{vocab - 1}")
    if t2d is not None and (int(t2d.sum()) != len(d2t) or not bool(t2d[ids].all())):
        raise ValueError(f"{source}: t2d does not mark exactly the target ids that d2t maps to")


def build_eagle3(own: dict, fc_state: dict, d2t: torch.Tensor, config: ModelConfig,
                 draft_vocab: int, features: int, bias: bool, layers: tuple[int, ...],
                 source: str, norm_before_residual: bool = False) -> Drafter:
    step = Eagle3Step(config, draft_vocab, norm_before_residual)
    load_into(step, own, source)
    fc = Eagle3Fc(features, config.hidden_size, bias)
    load_into(fc, fc_state, source)
    return Drafter("eagle3", [step.eval()], fc.eval(), d2t, layers)
