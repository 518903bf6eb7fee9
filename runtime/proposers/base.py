"""The interface every proposer implements."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import numpy as np


@dataclass
class Drafts:
    """Per stream, in the order of the streams passed to `propose`."""

    tokens: list[np.ndarray]  # [k_i] int64 (k_i may be below the k asked, 0 included)
    probs: list[np.ndarray | None]  # [k_i, vocab] q at each draft position; None: deterministic


class Proposer(ABC):
    name: str
    # The target's per-token output this proposer drafts from ("hidden_states",
    # "eagle3_features"); the engine passes its rows to `observe`. None: token ids only.
    reads: str | None = None

    @abstractmethod
    def propose(self, streams: list, ks: list[int]) -> Drafts:
        """Drafts up to ks[i] tokens to follow each stream's tokens (prompt + output)."""

    def observe(self, stream, start: int, rows: np.ndarray) -> None:
        """The target's `reads` output for the stream's positions [start, start + len(rows)),
        rows [n, D]: after prefill, and after each verification for the accepted positions."""

    def commit(self, stream) -> None:
        """Called after the stream's output grew: drop state built on rejected drafts."""

    def release(self, stream) -> None:
        """Called when the stream finishes and its slot is freed."""
