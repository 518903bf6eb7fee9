"""RoPE as transformers computes it: the scaling kinds read from config.json, and the cos / sin
tables every attention form indexes with position_ids.

    cos_cache, sin_cache  [max_position_embeddings, rotary_dim / 2]
    row p = (cos, sin)(p * inv_freq(p)) * attention_factor

Each kind changes inv_freq (formulas: transformers' modeling_rope_utils.py, 5.x; a line each
in docs/families.md). Two kinds depend on the length: longrope (short factors while the
sequence is at most original_max_position_embeddings long, long factors above) and dynamic
NTK (the base grows with the length). transformers decides both by max(position_ids) + 1 of
each forward call. Here row p decides by its own length p + 1, so

- a token's cos / sin depend on its position only: a token scores the same whether it is
  verified alone or beside k drafts, in a prefill chunk or a decode step (speculative decoding
  stays lossless, and every kind stays one static table: no graph or attention op changes);
- token-by-token decoding with a KV cache equals transformers' forward calls with a cache,
  one token at a time, at every length;
- what differs from transformers' one-shot forward over a sequence longer than the switch:
  there every token, those before the switch too, takes the long factors (or the grown base);
  here they keep the short ones (their keys were cached with them). transformers' own cached
  decoding has the same split, except Phi-3's generate(), which re-encodes the whole sequence
  with long factors once it passes original_max_position_embeddings.

Refused at load (a message naming the field and value): other kinds (e.g. mrope), a kind
missing its factor, and (export/checkpoint.py) scaling per layer type (Gemma 3's
rope_parameters.full_attention other than default). Factor lists of the wrong length and a
partial rotary dim that is odd or empty are refused by ModelConfig.
"""

from __future__ import annotations

import math

import torch

from trt_spec.runtime.config import ROPE_KINDS, ModelConfig, RopeScaling

# transformers' older spellings of a kind: Phi-3's "su" and "yarn" are its longrope
# (Phi3Config.convert_rope_params_to_dict).
PHI3_ALIASES = {"su": "longrope", "yarn": "longrope"}


def rope_kind(params: dict, phi3: bool = False) -> str:
    """The kind of a rope_scaling / rope_parameters dict (transformers 4: `type`, 5:
    `rope_type`)."""
    kind = params.get("rope_type", params.get("type", "default"))
    if phi3:
        kind = PHI3_ALIASES.get(kind, kind)
    if kind not in ROPE_KINDS:
        raise ValueError(f"rope_scaling rope_type {kind!r} is not supported; supported: "
                         f"{', '.join(ROPE_KINDS)}")
    return kind


def scaling_from_hf(params: dict | None, hf: dict, phi3: bool = False) -> RopeScaling:
    """config.json's rope_scaling / rope_parameters (flat) -> RopeScaling, with transformers'
    defaults: original_max_position_embeddings from the top level first (Phi-3 keeps it there,
    default 4096), then the dict, then max_position_embeddings; yarn's and longrope's
    attention factor from factor (and mscale / mscale_all_dim) when not given."""
    params = params or {}
    kind = rope_kind(params, phi3)
    if kind == "default":
        return RopeScaling()
    max_pos = hf.get("max_position_embeddings", 2048)
    if "original_max_position_embeddings" in hf or phi3:
        original = hf.get("original_max_position_embeddings", 4096)
    else:
        original = params.get("original_max_position_embeddings", max_pos)
    if kind == "dynamic":  # transformers' threshold: the config's max_position_embeddings
        original = max_pos
    factor = params.get("factor")
    if factor is None and kind in ("linear", "dynamic", "llama3"):
        raise ValueError(f"rope_scaling {kind!r} has no 'factor'")
    if factor is None:  # yarn / longrope: the ratio of the lengths (DeepSeek-V3, Phi-3)
        factor = max_pos / original
    factor = float(factor)
    extra = {}
    if kind == "llama3":
        extra = dict(low_freq_factor=float(params["low_freq_factor"]),
                     high_freq_factor=float(params["high_freq_factor"]))
    elif kind == "yarn":
        extra = dict(beta_fast=float(params.get("beta_fast") or 32),
                     beta_slow=float(params.get("beta_slow") or 1),
                     truncate=bool(params.get("truncate", True)),
                     attention_factor=yarn_attention_factor(params, factor))
    elif kind == "longrope":
        attention = params.get("attention_factor")
        if attention is None:
            attention = (1.0 if factor <= 1.0 else
                         math.sqrt(1 + math.log(factor) / math.log(original)))
        extra = dict(attention_factor=float(attention),
                     short_factor=tuple(params["short_factor"]),
                     long_factor=tuple(params["long_factor"]))
    return RopeScaling(kind=kind, factor=factor, original_max_position_embeddings=int(original),
                       **extra)


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def yarn_attention_factor(params: dict, factor: float) -> float:
    if params.get("attention_factor") is not None:
        return float(params["attention_factor"])
    mscale, all_dim = params.get("mscale"), params.get("mscale_all_dim")
    if mscale and all_dim:
        return yarn_mscale(factor, mscale) / yarn_mscale(factor, all_dim)
    return yarn_mscale(factor)


def max_positions(hf: dict, scaling: RopeScaling) -> int:
    """The positions the engine takes: config.json's max_position_embeddings, except dynamic
    NTK, whose config gives the length the base starts growing from: factor times it."""
    max_pos = hf.get("max_position_embeddings", 2048)
    return int(max_pos * scaling.factor) if scaling.kind == "dynamic" else max_pos


# --- tables -------------------------------------------------------------------------------

def plain_inv_freq(theta: float, dim: int) -> torch.Tensor:
    """[dim / 2] float64: theta^(-2i / dim)."""
    return 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)


def static_inv_freq(r: RopeScaling, theta: float, dim: int) -> torch.Tensor:
    """inv_freq [dim / 2] of the kinds that do not depend on the length."""
    inv = plain_inv_freq(theta, dim)
    if r.kind == "linear":
        return inv / r.factor
    if r.kind == "llama3":
        low_wavelen = r.original_max_position_embeddings / r.low_freq_factor
        high_wavelen = r.original_max_position_embeddings / r.high_freq_factor
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_wavelen, inv / r.factor, inv)
        smooth = ((r.original_max_position_embeddings / wavelen - r.low_freq_factor)
                  / (r.high_freq_factor - r.low_freq_factor))
        smoothed = (1 - smooth) * scaled / r.factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(medium, smoothed, scaled)
    if r.kind == "yarn":
        def correction_dim(rotations: float) -> float:
            return (dim * math.log(r.original_max_position_embeddings / (rotations * 2 * math.pi))
                    / (2 * math.log(theta)))

        low, high = correction_dim(r.beta_fast), correction_dim(r.beta_slow)
        if r.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        if low == high:
            high += 0.001  # transformers' guard against a zero-width ramp
        ramp = ((torch.arange(dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
        extrapolation = 1 - ramp  # 1: keep the frequency, 0: divide it by factor
        return inv / r.factor * (1 - extrapolation) + inv * extrapolation
    assert r.kind == "default", r.kind
    return inv


def row_inv_freq(r: RopeScaling, theta: float, dim: int, rows: int) -> torch.Tensor:
    """inv_freq of each row [rows, dim / 2]: row p decides by the length p + 1 (module
    docstring)."""
    length = torch.arange(1, rows + 1, dtype=torch.float64)[:, None]  # (rows, 1) p + 1
    original = r.original_max_position_embeddings
    if r.kind == "longrope":
        shape = theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
        short = 1.0 / (torch.tensor(r.short_factor, dtype=torch.float64) * shape)
        long = 1.0 / (torch.tensor(r.long_factor, dtype=torch.float64) * shape)
        return torch.where(length > original, long, short)
    if r.kind == "dynamic":  # base * (factor * len / original - (factor - 1))^(dim / (dim - 2))
        grown = length.clamp_min(original)
        base = theta * (r.factor * grown / original - (r.factor - 1)) ** (dim / (dim - 2))
        return 1.0 / base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    return static_inv_freq(r, theta, dim).expand(rows, -1)


def rope_tables(config: ModelConfig, theta: float | None = None,
                scaling: RopeScaling | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin: [max_position_embeddings, rotary_dim / 2] float32, the attention factor
    folded in. theta / scaling: default config.rope_theta / config.rope_scaling (a sliding
    layer's local base passes its theta and the plain kind)."""
    r = config.rope_scaling if scaling is None else scaling
    rows = config.max_position_embeddings
    inv = row_inv_freq(r, theta or config.rope_theta, config.rotary_dim, rows)  # (rows, d/2)
    angles = torch.arange(rows, dtype=torch.float64)[:, None] * inv
    return ((angles.cos() * r.attention_factor).float(),
            (angles.sin() * r.attention_factor).float())
