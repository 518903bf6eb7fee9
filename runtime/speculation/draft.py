"""One stream's draft for one step: the row the planner cuts, the grammar holds and the
target verifies."""

from __future__ import annotations

from dataclasses import dataclass, replace

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
    # where the grammar's forced run after the drafter's tokens starts (hold_to_grammar:
    # free, accepted whenever the drafts before it are); None: no such run
    forced_from: int | None = None

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def finite(self) -> bool:
        """Whether q and the confidences are finite numbers (a drafter's NaN: not a draft the
        verifier can judge, min(1, p / q) being NaN)."""
        q_ok = self.q is None or not len(self) or bool(np.isfinite(self.q.sum()))
        return q_ok and (not self.confidence or bool(np.isfinite(self.confidence[1]).all()))

    @property
    def drafted(self) -> int:
        """The drafter's own tokens (without a forced run after them)."""
        return len(self) if self.forced_from is None else self.forced_from

    def extend_forced(self, tokens: list[int]) -> None:
        """The grammar's forced run after the drafter's tokens (q: certain, one-hot)."""
        if not tokens:
            return
        self.forced_from = len(self)
        if self.q is not None:
            rows = np.zeros((len(tokens), self.q.shape[-1]), dtype=self.q.dtype)
            rows[np.arange(len(tokens)), tokens] = 1
            self.q = np.concatenate([self.q, rows])
        self.tokens = np.concatenate([self.tokens, np.asarray(tokens, dtype=np.int64)])

    def cut(self, n: int) -> None:
        """Keeps the first n tokens (and their q and confidences)."""
        if self.forced_from is not None and n <= self.forced_from:
            self.forced_from = None
        self.tokens = self.tokens[:n]
        if self.q is not None:
            self.q = self.q[:n]
        if self.confidence:
            self.confidence = (self.confidence[0], self.confidence[1][:n])

    def sources(self, step: int, accepted: int, emitted: int) -> list[TokenSource]:
        """The origins of the `emitted` tokens its step kept (runtime/provenance.py)."""
        out = step_sources(step, self.source, self.drafted, accepted, emitted, self.corpus)
        if self.forced_from is not None:  # the run the grammar forced after the drafts
            out = [replace(t, source=GRAMMAR) if self.forced_from < t.position <= accepted
                   else t for t in out]
        return out

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
