"""Model configuration shared by the exporter and the runtime (no torch here)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

ROPE_KINDS = ("default", "linear", "dynamic", "llama3", "yarn", "longrope")


@dataclass(frozen=True)
class RopeScaling:
    """How the RoPE frequencies are scaled, as transformers' `rope_parameters` names it
    (export/rope.py builds the tables; docs/families.md states each formula). Defaults: the
    plain RoPE of base `ModelConfig.rope_theta`."""

    kind: str = "default"  # one of ROPE_KINDS
    factor: float = 1.0  # linear / dynamic / llama3 / yarn (longrope: max_pos / original)
    # The pretraining length: llama3's wavelength bands, yarn's correction range, longrope's
    # short / long switch, dynamic's length from which the base grows.
    original_max_position_embeddings: int = 0
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    beta_fast: float = 32.0  # yarn
    beta_slow: float = 1.0  # yarn
    truncate: bool = True  # yarn: floor / ceil the correction range
    attention_factor: float = 1.0  # yarn / longrope: cos and sin are multiplied by it
    short_factor: tuple[float, ...] = ()  # longrope: [rotary_dim / 2], rows p + 1 <= original
    long_factor: tuple[float, ...] = ()  # longrope: [rotary_dim / 2], rows p + 1 > original

    def __post_init__(self):
        if self.kind not in ROPE_KINDS:
            raise ValueError(f"rope kind {self.kind!r}; known: {', '.join(ROPE_KINDS)}")
        object.__setattr__(self, "short_factor", tuple(float(f) for f in self.short_factor))
        object.__setattr__(self, "long_factor", tuple(float(f) for f in self.long_factor))
        if self.kind in ("dynamic", "llama3", "yarn", "longrope") and \
                self.original_max_position_embeddings <= 0:
            raise ValueError(f"rope kind {self.kind!r} needs original_max_position_embeddings "
                             f"> 0, got {self.original_max_position_embeddings}")


@dataclass(frozen=True)
class ModelConfig:
    """A Llama-style decoder and the family options on it (Qwen2/2.5, Qwen3, Gemma 3,
    Phi-3), each a flag with the Llama value as its default. Field names follow the symbols
    used in shape comments.

    What the checkpoint loader folds into the weights instead (export/checkpoint.py): Gemma's
    RMSNorm weight offset (x * (1 + w)) and its attention scale (query_pre_attn_scalar^-0.5,
    folded into the q norm), so the graph keeps the plain norm and head_dim^-0.5.
    """

    vocab_size: int
    hidden_size: int  # H
    intermediate_size: int
    num_layers: int  # L
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = True
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # Inputs to these decoder layers are concatenated into the Eagle3 feature output.
    eagle3_layers: tuple[int, ...] = ()
    # --- family options (defaults: Llama) ---
    family: str = "llama"  # "llama" | "qwen2" | "qwen3" | "gemma3" | "phi3": the weight names
    attention_bias: bool = False  # q/k/v projections carry biases (Qwen2)
    qk_norm: bool = False  # RMS norm over head_dim on each q and k head before RoPE (Qwen3, Gemma 3)
    sandwich_norm: bool = False  # norms on the attention and MLP outputs before the adds (Gemma 3)
    hidden_act: str = "silu"  # the MLP gate's activation: "silu" | "gelu_tanh"
    embed_scale: float = 1.0  # embeddings multiplied by it (Gemma: sqrt(H))
    logit_softcap: float = 0.0  # logits = c * tanh(logits / c) when > 0 (Gemma's final softcap)
    # Sliding-window attention: query at position i sees keys j with i - window < j <= i on the
    # layers marked "sliding_attention" in layer_types (empty: every layer "full_attention").
    sliding_window: int = 0
    layer_types: tuple[str, ...] = ()
    rope_local_theta: float = 0.0  # RoPE base of the sliding layers (0: rope_theta)
    # RoPE scaling of the (full-attention) layers; the sliding layers' local base is plain.
    rope_scaling: RopeScaling = RopeScaling()
    # RoPE turns the first rotary_dim = int(head_dim * partial_rotary_factor) dims of each
    # head; the rest pass through (Phi-4-mini: 0.75).
    partial_rotary_factor: float = 1.0

    def __post_init__(self):
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}"
            )
        if not self.eagle3_layers:
            object.__setattr__(self, "eagle3_layers", default_eagle3_layers(self.num_layers))
        for i in self.eagle3_layers:
            if not 0 <= i < self.num_layers:
                raise ValueError(f"eagle3 layer {i} is outside 0..{self.num_layers - 1}")
        if self.hidden_act not in HIDDEN_ACTS:
            raise ValueError(f"hidden_act {self.hidden_act!r}; supported: {', '.join(HIDDEN_ACTS)}")
        types = tuple(self.layer_types)
        if len(types) > self.num_layers:  # a truncated model (a self-draft): its first layers
            types = types[:self.num_layers]
        if types and len(types) != self.num_layers:
            raise ValueError(f"layer_types has {len(types)} entries for {self.num_layers} layers")
        unknown = sorted(set(types) - set(LAYER_TYPES))
        if unknown:
            raise ValueError(f"layer types {unknown}; known: {', '.join(LAYER_TYPES)}")
        if "sliding_attention" in types and self.sliding_window <= 0:
            raise ValueError("sliding_attention layers need sliding_window > 0, got "
                             f"{self.sliding_window}")
        object.__setattr__(self, "layer_types", types)
        if isinstance(self.rope_scaling, dict):  # from_dict, or a caller's plain dict
            object.__setattr__(self, "rope_scaling", RopeScaling(**self.rope_scaling))
        rotary = self.rotary_dim
        if not 0 < rotary <= self.head_dim or rotary % 2:
            raise ValueError(f"partial_rotary_factor={self.partial_rotary_factor} gives rotary "
                             f"dim {rotary} for head_dim {self.head_dim}; need an even dim in "
                             f"2..{self.head_dim}")
        r = self.rope_scaling
        if r.kind == "longrope":
            for name in ("short_factor", "long_factor"):
                if len(getattr(r, name)) != rotary // 2:
                    raise ValueError(f"rope {name} has {len(getattr(r, name))} entries; "
                                     f"rotary dim {rotary} needs {rotary // 2}")

    @property
    def rotary_dim(self) -> int:
        """The dims of each q / k head that RoPE turns (the first ones)."""
        return int(self.head_dim * self.partial_rotary_factor)

    def layer_window(self, i: int) -> int:
        """Layer i's sliding window (keys i - window < j <= i), or 0: full causal attention."""
        sliding = self.layer_types and self.layer_types[i] == "sliding_attention"
        return self.sliding_window if sliding else 0

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["eos_token_ids"] = list(self.eos_token_ids)
        d["eagle3_layers"] = list(self.eagle3_layers)
        d["layer_types"] = list(self.layer_types)
        d["rope_scaling"]["short_factor"] = list(self.rope_scaling.short_factor)
        d["rope_scaling"]["long_factor"] = list(self.rope_scaling.long_factor)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "ModelConfig":
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - names
        if unknown:
            raise ValueError(f"unknown model config keys: {sorted(unknown)}")
        d = dict(d)
        d["eos_token_ids"] = tuple(d.get("eos_token_ids", ()))
        d["eagle3_layers"] = tuple(d.get("eagle3_layers", ()))
        d["layer_types"] = tuple(d.get("layer_types", ()))
        d["rope_scaling"] = RopeScaling(**d.get("rope_scaling", {}))  # absent: plain RoPE
        return cls(**d)


HIDDEN_ACTS = ("silu", "gelu_tanh")
LAYER_TYPES = ("full_attention", "sliding_attention")


def default_eagle3_layers(num_layers: int) -> tuple[int, ...]:
    """Low, middle and high feature layers, as EAGLE-3 picks them: (2, L/2, L-3)."""
    layers = (min(2, num_layers - 1), num_layers // 2, max(num_layers - 3, 0))
    return layers

