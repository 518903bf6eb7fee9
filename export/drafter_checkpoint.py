"""Drafter checkpoints: the layouts people publish, and the project's own.

- EAGLE3, as published by EAGLE / SpecForge (`fc.weight`, `midlayer.*`, `norm.weight`,
  `lm_head.weight`, `d2t`, `t2d`) or in the `model.fc` / `model.layers.0.*` layout;
  config.json with `draft_vocab_size`, `target_hidden_size`, and optionally
  `eagle_aux_hidden_state_layer_ids` (inputs to those target layers, as vLLM reads them).
- DeepSeek-V3 MTP: `model.layers.{L+i}.{enorm,hnorm,eh_proj,shared_head.norm,shared_head.head,
  embed_tokens, <a Llama decoder layer>}` for i < num_nextn_predict_layers (MLA / MoE layers
  are refused). The target's own keys may sit beside them and are skipped.
- trt-spec's own: `drafter.json` + `model.safetensors` under the module's own names (what the
  trainer writes; `save_drafter`). Its "kind" is the method's train name (runtime/methods.py).

Which reader a method's checkpoint goes to is a table by method (PUBLISHED, OWN_READERS, checked
against the registry's heads below); Eagle, a looped method, takes module 0 of MTP's layouts.

Strict like the target's loader: every key is mapped, shapes are checked against the config,
and a missing, unexpected or mis-shaped key fails with its name. What a drafter may take from
the target (embedding; an MTP module's final norm and head) is taken when absent.
"""

from __future__ import annotations

import dataclasses
import json
from functools import partial
from pathlib import Path

import torch

from trt_spec.export.checkpoint import StrictState, load_into
from trt_spec.export.drafters import KINDS, Drafter, Eagle3Fc, Eagle3Step, MTPModule
from trt_spec.export.model import TargetModel
from trt_spec.export.rope import scaling_from_hf
from trt_spec.runtime.config import ModelConfig
from trt_spec.runtime.methods import METHODS

OWN_FORMAT = "trt-spec-drafter"
OWN_VERSION = 1
DRAFT_KIND = METHODS["vanilla"].train_name  # drafter.json "kind" of a vanilla draft model


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


def layer_config(hf: dict, target: ModelConfig) -> ModelConfig:
    """The one decoder layer of a drafter, from its config.json (Llama names)."""
    for key in ("kv_lora_rank", "q_lora_rank"):
        if hf.get(key):
            raise ValueError(f"config has {key}={hf[key]}: MLA attention layers are not "
                             "supported; only Llama-style (GQA) drafter layers")
    for flag in ("attention_bias", "mlp_bias"):
        if hf.get(flag):
            raise ValueError(f"config has {flag}=true; only bias-free Llama layers are supported")
    if hf.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act {hf['hidden_act']!r} is not supported; only 'silu'")
    vocab = hf.get("vocab_size", target.vocab_size)
    if vocab != target.vocab_size:
        raise ValueError(f"drafter vocab_size {vocab} != the target's {target.vocab_size}: "
                         "a drafter must share the target's vocabulary")
    heads = hf.get("num_attention_heads", target.num_heads)
    hidden = hf.get("hidden_size", target.hidden_size)
    return ModelConfig(
        vocab_size=target.vocab_size,
        hidden_size=hidden,
        intermediate_size=hf.get("intermediate_size", target.intermediate_size),
        num_layers=1,
        num_heads=heads,
        num_kv_heads=hf.get("num_key_value_heads") or heads,
        head_dim=hf.get("head_dim") or hidden // heads,
        rms_norm_eps=hf.get("rms_norm_eps", target.rms_norm_eps),
        max_position_embeddings=target.max_position_embeddings,
        tie_word_embeddings=False,
        eagle3_layers=(0,),
        **drafter_rope(hf, target),
    )


def drafter_rope(hf: dict, target: ModelConfig) -> dict:
    """A drafter layer's RoPE (ModelConfig fields): its config.json's when that names a
    rope_scaling / rope_parameters (null: the plain RoPE; e.g. the EAGLE3 heads for Llama 3.1
    carry the target's llama3 block), else the target's (DeepSeek-V3 MTP modules and heads
    whose config says nothing apply the target's RoPE). Refused like the target's."""
    theta = float(hf.get("rope_theta", target.rope_theta))
    if "rope_scaling" not in hf and "rope_parameters" not in hf:
        return dict(rope_theta=theta, rope_scaling=target.rope_scaling,
                    partial_rotary_factor=float(hf.get("partial_rotary_factor",
                                                       target.partial_rotary_factor)))
    params = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    own = {"max_position_embeddings": target.max_position_embeddings, **hf}
    return dict(rope_theta=float(params.get("rope_theta", theta)),
                rope_scaling=scaling_from_hf(params, own),
                partial_rotary_factor=float(params.get("partial_rotary_factor",
                                                       hf.get("partial_rotary_factor", 1.0))))


def take_layer(state: StrictState, prefix: str, c: ModelConfig, qkv_in: int) -> dict:
    """A Llama decoder layer's keys under `prefix` -> DecoderLayer's (q/k/v, gate/up fused)."""
    h, hd = c.hidden_size, c.head_dim
    if state.has(prefix + "self_attn.kv_a_proj_with_mqa.weight"):
        raise ValueError(f"{state.source}: {prefix}self_attn is MLA; only Llama-style attention "
                         "drafter layers are supported")
    if any(k.startswith(prefix + "mlp.experts.") for k in state.tensors):
        raise ValueError(f"{state.source}: {prefix}mlp is a mixture of experts; only dense "
                         "drafter layers are supported")
    q = state.take(prefix + "self_attn.q_proj.weight", (c.num_heads * hd, qkv_in))
    k = state.take(prefix + "self_attn.k_proj.weight", (c.num_kv_heads * hd, qkv_in))
    v = state.take(prefix + "self_attn.v_proj.weight", (c.num_kv_heads * hd, qkv_in))
    return {
        "layer.input_layernorm": state.take(prefix + "input_layernorm.weight", (h,)),
        "layer.qkv_proj.weight": torch.cat([q, k, v], dim=0),
        "layer.o_proj.weight": state.take(prefix + "self_attn.o_proj.weight", (h, c.num_heads * hd)),
        "layer.post_attention_layernorm": state.take(prefix + "post_attention_layernorm.weight", (h,)),
        "layer.gate_up_proj.weight": torch.cat([
            state.take(prefix + "mlp.gate_proj.weight", (c.intermediate_size, h)),
            state.take(prefix + "mlp.up_proj.weight", (c.intermediate_size, h))], dim=0),
        "layer.down_proj.weight": state.take(prefix + "mlp.down_proj.weight", (h, c.intermediate_size)),
    }


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


# --- DeepSeek-V3 MTP ----------------------------------------------------------------------

def load_mtp(folder: Path, target: TargetModel, kind: str = "mtp") -> Drafter:
    """DeepSeek-V3-style MTP modules from `folder` (it may be the full target checkpoint).
    A looped kind (Eagle) takes module 0 only."""
    folder = Path(folder)
    hf = read_config(folder)
    t = target.config
    layers = hf.get("num_hidden_layers", t.num_layers)
    if layers != t.num_layers:
        raise ValueError(f"{folder}: num_hidden_layers {layers} != the target's {t.num_layers} "
                         "(MTP modules are numbered after the target's layers)")
    n = hf.get("num_nextn_predict_layers")
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"{folder}/config.json: num_nextn_predict_layers={n!r}; an MTP "
                         "checkpoint needs an integer >= 1")
    if hf.get("n_routed_experts") and hf.get("first_k_dense_replace", 0) <= layers:
        raise ValueError(f"{folder}: the MTP layers are mixture-of-experts layers "
                         f"(n_routed_experts={hf['n_routed_experts']}); only dense layers are "
                         "supported")
    config = layer_config(hf, t)
    state = StrictState(read_tensors(folder), str(folder))
    h = config.hidden_size
    modules = []
    for i in range(n):
        p = f"model.layers.{layers + i}."
        if METHODS[kind].looped and i > 0:
            state.skip([k for k in state.tensors if k.startswith(p)])
            continue
        own = take_layer(state, p, config, h)
        own["enorm"] = state.take(p + "enorm.weight", (h,))
        own["hnorm"] = state.take(p + "hnorm.weight", (h,))
        own["eh_proj.weight"] = state.take(p + "eh_proj.weight", (h, 2 * h))
        for ours, theirs in (("head_norm", "shared_head.norm.weight"),
                             ("lm_head.weight", "shared_head.head.weight"),
                             ("embed_tokens.weight", "embed_tokens.weight")):
            if state.has(p + theirs):
                own[ours] = state.take(p + theirs)
        modules.append(build_mtp_module(own, config, target, f"{folder} module {i}"))
    # The target's own weights may share the checkpoint (DeepSeek-V3 ships them together).
    state.skip([k for k in state.tensors if k in ("model.embed_tokens.weight",
                                                  "model.norm.weight", "lm_head.weight")
                or any(k.startswith(f"model.layers.{j}.") for j in range(layers))])
    state.finish()
    return Drafter(kind, modules)


# --- EAGLE3 -----------------------------------------------------------------------------

EAGLE3_LAYOUTS = {  # name -> (layer prefix, fc, final norm, head, embedding)
    "midlayer": ("midlayer.", "fc.", "norm.weight", "lm_head.weight", "embed_tokens.weight"),
    "model": ("model.layers.0.", "model.fc.", "model.norm.weight", "lm_head.weight",
              "model.embed_tokens.weight"),
}


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


def load_eagle3(folder: Path, target: TargetModel) -> Drafter:
    folder = Path(folder)
    hf = read_config(folder)
    t = target.config
    config = layer_config(hf, t)
    h, source = config.hidden_size, str(folder)
    target_hidden = hf.get("target_hidden_size") or t.hidden_size
    if target_hidden != t.hidden_size:
        raise ValueError(f"{source}: target_hidden_size {target_hidden} != the target's "
                         f"hidden_size {t.hidden_size}")
    draft_vocab = hf.get("draft_vocab_size") or t.vocab_size
    state = StrictState(read_tensors(folder), source)
    layout = next((name for name, keys in EAGLE3_LAYOUTS.items()
                   if state.has(keys[0] + "input_layernorm.weight")), None)
    if layout is None:
        raise KeyError(f"{source}: not an EAGLE3 checkpoint: expected 'midlayer.*' or "
                       "'model.layers.0.*' keys")
    layer, fc, norm, head, embed = EAGLE3_LAYOUTS[layout]
    features = 3 * t.hidden_size
    bias = bool(hf.get("fc_bias", hf.get("bias", False)))
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
                        eagle3_layer_ids(hf, t, source), source)


def check_vocab_map(d2t: torch.Tensor, t2d: torch.Tensor | None, vocab: int, source: str) -> None:
    ids = torch.arange(len(d2t)) + d2t
    if ids.min() < 0 or ids.max() >= vocab:
        raise ValueError(f"{source}: d2t maps draft ids outside the target vocabulary 0..{vocab - 1}")
    if t2d is not None and (int(t2d.sum()) != len(d2t) or not bool(t2d[ids].all())):
        raise ValueError(f"{source}: t2d does not mark exactly the target ids that d2t maps to")


def build_eagle3(own: dict, fc_state: dict, d2t: torch.Tensor, config: ModelConfig,
                 draft_vocab: int, features: int, bias: bool, layers: tuple[int, ...],
                 source: str) -> Drafter:
    step = Eagle3Step(config, draft_vocab)
    load_into(step, own, source)
    fc = Eagle3Fc(features, config.hidden_size, bias)
    load_into(fc, fc_state, source)
    return Drafter("eagle3", [step.eval()], fc.eval(), d2t, layers)


# --- trt-spec's own format --------------------------------------------------------------

def half(t: torch.Tensor) -> torch.Tensor:
    """Float tensors stored as fp16 (the shipped format), others as they are."""
    return (t.half() if t.is_floating_point() else t).contiguous()


def save_drafter(drafter: Drafter, folder: Path) -> None:
    """drafter.json + model.safetensors (fp16); the embedding (and an MTP head that is the
    target's) is left out: the loader takes it from the target."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for i, module in enumerate(drafter.modules):
        for key, value in module.state_dict().items():
            if key == "embed_tokens.weight":
                continue
            tensors[f"modules.{i}.{key}"] = half(value)
    if drafter.fc is not None:
        tensors.update({f"fc.{k}": half(v) for k, v in drafter.fc.state_dict().items()})
        tensors["d2t"] = drafter.d2t.contiguous()
    meta = {"format": OWN_FORMAT, "version": OWN_VERSION, "kind": drafter.kind,
            "num_modules": len(drafter.modules),
            "layer_config": drafter.config.to_dict()}
    if drafter.fc is not None:  # Eagle3
        meta.update(draft_vocab_size=len(drafter.d2t), feature_layers=list(drafter.feature_layers),
                    fc_bias=drafter.fc.fc.bias is not None)
    save_file(tensors, str(folder / "model.safetensors"))
    (folder / "drafter.json").write_text(json.dumps(meta, indent=2) + "\n")


def load_own(folder: Path, target: TargetModel, kind: str) -> Drafter:
    """A drafter saved by save_drafter, read by the reader of the kind it holds (OWN_READERS)."""
    folder = Path(folder)
    meta = read_config(folder, "drafter.json")
    source = str(folder)
    if meta.get("format") != OWN_FORMAT or meta.get("version") != OWN_VERSION:
        raise ValueError(f"{source}/drafter.json: format {meta.get('format')!r} version "
                         f"{meta.get('version')!r}; this loader reads {OWN_FORMAT!r} "
                         f"version {OWN_VERSION}")
    held = meta["kind"]
    # a looped method (Eagle) reads module 0 of a checkpoint of the same modules (MTP's)
    if held != kind and not (METHODS[kind].looped and OWN_READERS.get(held) is OWN_READERS[kind]):
        raise ValueError(f"{source} holds a {held!r} drafter, not {kind!r}")
    t = target.config
    config = ModelConfig.from_dict(meta["layer_config"])
    if config.vocab_size != t.vocab_size:
        raise ValueError(f"{source}: drafter vocab_size {config.vocab_size} != the target's "
                         f"{t.vocab_size}")
    config = dataclasses.replace(config, max_position_embeddings=t.max_position_embeddings)
    groups: dict[str, dict] = {}  # "modules.{i}" | "fc" | "d2t" -> {key within it: tensor}
    for key, value in read_tensors(folder).items():
        if key.startswith("modules."):
            _, i, rest = key.split(".", 2)
            groups.setdefault(f"modules.{i}", {})[rest] = value
        else:
            head, _, rest = key.partition(".")
            groups.setdefault(head, {})[rest or key] = value
    return OWN_READERS[held](groups, meta, config, target, kind, source)


def check_groups(groups: dict, expected: set[str], source: str) -> None:
    unexpected = sorted(set(groups) - expected)
    if unexpected:
        raise KeyError(f"{source}: unexpected checkpoint keys under {unexpected}")


def own_modules(groups: dict, meta: dict, config: ModelConfig, target: TargetModel, kind: str,
                source: str) -> Drafter:
    """MTP's modules from their tensor groups (a looped kind: module 0 only)."""
    check_groups(groups, {f"modules.{i}" for i in range(meta["num_modules"])}, source)
    n = 1 if METHODS[kind].looped else meta["num_modules"]
    modules = []
    for i in range(n):
        if f"modules.{i}" not in groups:
            raise KeyError(f"{source}: checkpoint is missing 'modules.{i}.*'")
        modules.append(build_mtp_module(groups[f"modules.{i}"], config, target,
                                        f"{source} module {i}"))
    return Drafter(kind, modules)


def own_eagle3(groups: dict, meta: dict, config: ModelConfig, target: TargetModel, kind: str,
               source: str) -> Drafter:
    """Eagle3's step, fc and draft vocabulary from their tensor groups."""
    t = target.config
    check_groups(groups, {f"modules.{i}" for i in range(meta["num_modules"])} | {"fc", "d2t"},
                 source)
    for name in ("modules.0", "fc", "d2t"):
        if name not in groups:
            raise KeyError(f"{source}: checkpoint is missing {name!r}")
    own = groups["modules.0"]
    if "embed_tokens.weight" not in own:
        own["embed_tokens.weight"] = target.embed_tokens.weight.detach()
    d2t = groups["d2t"]["d2t"].long()
    check_vocab_map(d2t, None, t.vocab_size, source)
    layers = eagle3_layer_ids({"eagle_aux_hidden_state_layer_ids": meta["feature_layers"]},
                              t, source)
    return build_eagle3(own, groups["fc"], d2t, config, meta["draft_vocab_size"],
                        3 * t.hidden_size, meta.get("fc_bias", False), layers, source)


# --- a vanilla draft model (train/draft.py) -------------------------------------------------

def save_draft(draft: TargetModel, folder: Path, source_layers: tuple[int, ...]) -> None:
    """drafter.json {format, version, kind: "draft", model_config, source_layers} +
    model.safetensors (layers.*, norm; fp16): the embedding (and an untied head) is the
    target's."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {k: half(v.detach().cpu()) for k, v in draft.state_dict().items()
               if k not in ("embed_tokens.weight", "lm_head.weight")}
    meta = {"format": OWN_FORMAT, "version": OWN_VERSION, "kind": DRAFT_KIND,
            "model_config": draft.config.to_dict(), "source_layers": list(source_layers)}
    save_file(tensors, str(folder / "model.safetensors"))
    (folder / "drafter.json").write_text(json.dumps(meta, indent=2) + "\n")


def is_draft_folder(path) -> bool:
    meta = Path(path) / "drafter.json"
    return meta.is_file() and json.loads(meta.read_text()).get("kind") == DRAFT_KIND


def load_draft(folder, target: TargetModel) -> TargetModel:
    """A draft saved by save_draft, with the target's embedding (and head when untied)."""
    folder = Path(folder)
    meta = json.loads((folder / "drafter.json").read_text())
    if (meta.get("format"), meta.get("version"), meta.get("kind")) != (OWN_FORMAT, OWN_VERSION,
                                                                        DRAFT_KIND):
        raise ValueError(f"{folder}/drafter.json: not a trt-spec draft checkpoint (format "
                         f"{meta.get('format')!r}, version {meta.get('version')!r}, kind "
                         f"{meta.get('kind')!r})")
    config = ModelConfig.from_dict(meta["model_config"])
    t = target.config
    for field in ("vocab_size", "hidden_size", "tie_word_embeddings"):
        if getattr(config, field) != getattr(t, field):
            raise ValueError(f"{folder}: draft {field} {getattr(config, field)} != the "
                             f"target's {getattr(t, field)}")
    config = dataclasses.replace(config, max_position_embeddings=t.max_position_embeddings,
                                 eagle3_layers=())
    state = read_tensors(folder)
    state["embed_tokens.weight"] = target.embed_tokens.weight.detach()
    if target.lm_head is not None:
        state["lm_head.weight"] = target.lm_head.weight.detach()
    draft = TargetModel(config)
    load_into(draft, state, str(folder))
    return draft.eval()


# --- by method ------------------------------------------------------------------------------

# the published layout each head reads, and the reader of each kind trt-spec's format holds
PUBLISHED = {"mtp": partial(load_mtp, kind="mtp"), "eagle": partial(load_mtp, kind="eagle"),
             "eagle3": load_eagle3}
OWN_READERS = {"mtp": own_modules, "eagle": own_modules, "eagle3": own_eagle3}
assert set(PUBLISHED) == set(OWN_READERS) == set(KINDS), (PUBLISHED, OWN_READERS, KINDS)


def load_drafter(path: str | Path, kind: str, target: TargetModel) -> Drafter:
    """`kind` from KINDS; the layout is recognised from the folder's files."""
    if kind not in KINDS:
        raise ValueError(f"drafter kind {kind!r}; known: {', '.join(KINDS)}")
    folder = Path(path)
    if not folder.is_dir():
        raise FileNotFoundError(f"{kind} checkpoint {str(path)!r} is not a folder")
    if (folder / "drafter.json").exists():
        return load_own(folder, target, kind)
    return PUBLISHED[kind](folder, target)
