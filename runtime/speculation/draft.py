"""One stream's draft for one step: the row the planner cuts, the grammar holds and the
target verifies."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from trt_spec.runtime.proposers.base import Drafts
from trt_spec.runtime.provenance import GRAMMAR, TokenSource, step_sources

NO_TOKENS = np.zeros(0, dtype=np.int64)


@dataclass
class Draft:
    tokens: np.ndarray  # [n] int64; n = 0: a plain row this step
    q: np.ndarray | None  # [n, vocab] the drafter's distribution per position; None: deterministic
    source: str  # who drafted: the method, a picking proposer's choice (hybrid, auto), GRAMMAR
    # what its acceptance is measured under within its method (hybrid, auto: the source, or a
    # lookup by its n-gram's length); None: the method's alone
    key: str | None = None
    # (calibration key, one confidence per token): what `auto` k learns from; None: nothing
    confidence: tuple[str, list[float]] | None = None
    corpus: bool = False  # a corpus chain drafted it (what token sources report)

    def __len__(self) -> int:
        return len(self.tokens)

    def cut(self, n: int) -> None:
        """Keeps the first n tokens (and their q and confidences)."""
        self.tokens = self.tokens[:n]
        if self.q is not None:
            self.q = self.q[:n]
        if self.confidence:
            self.confidence = (self.confidence[0], self.confidence[1][:n])

    def sources(self, step: int, accepted: int, emitted: int) -> list[TokenSource]:
        """The origins of the `emitted` tokens its step kept (runtime/provenance.py)."""
        return step_sources(step, self.source, len(self), accepted, emitted, self.corpus)

    @classmethod
    def none(cls, method: str) -> "Draft":
        return cls(NO_TOKENS, None, method)

    @classmethod
    def forced(cls, tokens: np.ndarray) -> "Draft":
        """The grammar allows exactly these tokens next: drafted for free."""
        return cls(tokens, None, GRAMMAR)

    @classmethod
    def row(cls, drafts: Drafts, j: int, method: str) -> "Draft":
        """Row j of a proposer's batched Drafts."""
        source = drafts.sources[j] if drafts.sources else None
        key = (drafts.keys[j] if drafts.keys else source) if drafts.sources else None
        corpus = bool(drafts.corpus and drafts.corpus[j])
        return cls(drafts.tokens[j], drafts.probs[j], source or method, key, corpus=corpus)
