"""Model configuration shared by the exporter and the runtime (no torch here)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass


@dataclass(frozen=True)
class ModelConfig:
    """A Llama-family decoder. Field names follow the symbols used in shape comments."""

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

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["eos_token_ids"] = list(self.eos_token_ids)
        d["eagle3_layers"] = list(self.eagle3_layers)
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
        return cls(**d)


def default_eagle3_layers(num_layers: int) -> tuple[int, ...]:
    """Low, middle and high feature layers, as EAGLE-3 picks them: (2, L/2, L-3)."""
    layers = (min(2, num_layers - 1), num_layers // 2, max(num_layers - 3, 0))
    return layers

