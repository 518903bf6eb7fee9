"""Sampling parameters and the logits -> token step shared by every engine.

`probs_from_logits` is the one place temperature, top-k and top-p are applied, so a
speculative sampler can apply them identically to the target (p) and the draft (q).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class SamplingParams:
    """Names follow vLLM's SamplingParams. temperature 0 means greedy."""

    max_tokens: int = 128
    temperature: float = 0.0
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1: off
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self):
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens={self.max_tokens!r}: must be an integer >= 1")
        if not self.temperature >= 0:  # also catches NaN
            raise ValueError(f"temperature={self.temperature!r}: must be >= 0 (0 = greedy)")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k={self.top_k!r}: must be an integer >= 0 (0 = off)")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={self.top_p!r}: must be in (0, 1]")
        if any(not s for s in self.stop):
            raise ValueError(f"stop={self.stop!r}: stop strings must be non-empty")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def probs_from_logits(logits: np.ndarray, temperature: float, top_k: int = 0,
                      top_p: float = 1.0) -> np.ndarray:
    """logits: [..., vocab] -> probabilities [..., vocab] (float64) after temperature, top-k
    (keep the k largest) and top-p (keep the smallest set whose mass reaches p)."""
    assert temperature > 0, temperature
    x = logits.astype(np.float64) / temperature
    if 0 < top_k < x.shape[-1]:
        kth = np.partition(x, -top_k, axis=-1)[..., -top_k, None]
        x = np.where(x < kth, -np.inf, x)
    x = np.exp(x - x.max(-1, keepdims=True))
    p = x / x.sum(-1, keepdims=True)
    if top_p < 1.0:
        order = np.argsort(-p, axis=-1, kind="stable")
        sorted_p = np.take_along_axis(p, order, -1)
        # keep a token if the mass before it is < top_p (so the first token always stays)
        keep_sorted = (np.cumsum(sorted_p, -1) - sorted_p) < top_p
        keep = np.empty_like(keep_sorted)
        np.put_along_axis(keep, order, keep_sorted, -1)
        p = np.where(keep, p, 0.0)
        p /= p.sum(-1, keepdims=True)
    return p


def sample_from_probs(p: np.ndarray, rng: np.random.Generator) -> int:
    """p: [vocab] -> one token id (inverse CDF; reproducible for a seeded rng)."""
    cdf = np.cumsum(p)
    return int(min(np.searchsorted(cdf, rng.random() * cdf[-1], side="right"), len(p) - 1))


def next_token(logits: np.ndarray, params: SamplingParams, rng: np.random.Generator) -> int:
    """logits: [vocab] -> token id."""
    if params.greedy:
        return int(np.argmax(logits))
    return sample_from_probs(probs_from_logits(logits, params.temperature, params.top_k,
                                               params.top_p), rng)
