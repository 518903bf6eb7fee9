"""Drafter checkpoints: the layouts people publish, and the project's own.

- Published heads (EAGLE3 as EAGLE, SpecForge, vLLM and speculators write it; MTP in the
  DeepSeek-V3, MiMo and Qwen3-Next layouts): export/published_heads.py, each layout's keys and
  config fields, and what is refused.
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

from trt_spec.export.checkpoint import load_into
from trt_spec.export.drafters import KINDS, Drafter
from trt_spec.export.model import TargetModel
from trt_spec.export.published_heads import (build_eagle3, build_mtp_module, check_vocab_map,
                                             eagle3_layer_ids, load_eagle3, load_mtp,
                                             read_config, read_tensors)
from trt_spec.runtime.config import ModelConfig
from trt_spec.runtime.methods import METHODS

OWN_FORMAT = "trt-spec-drafter"
OWN_VERSION = 1
DRAFT_KIND = METHODS["vanilla"].train_name  # drafter.json "kind" of a vanilla draft model


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
                    fc_bias=drafter.fc.fc.bias is not None,
                    norm_before_residual=drafter.modules[0].norm_before_residual)
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
                        3 * t.hidden_size, meta.get("fc_bias", False), layers, source,
                        meta.get("norm_before_residual", False))


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
