"""The interface every proposer implements, and how a drafter's logits become a draft."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import numpy as np

from trt_spec.runtime.race import race
from trt_spec.runtime.sampling import probs, process_logits


@dataclass
class Drafts:
    """Per stream, in the order of the streams passed to `propose`."""

    tokens: list[np.ndarray]  # [k_i] int64 (k_i may be below the k asked, 0 included)
    probs: list[np.ndarray | None]  # [k_i, vocab] q at each draft position; None: deterministic
    sources: list[str | None] | None = None  # which proposer drafted (hybrid); None: this one
    # what each stream's acceptance is measured under, within its method (auto: the source,
    # a lookup by the length of the n-gram it matched); None: the sources
    keys: list[str | None] | None = None
    # per stream, whether its draft is a corpus chain (runtime/corpus.py), not a lookup in
    # the request's or earlier requests' tokens: what token sources report; None: none is
    corpus: list[bool] | None = None


def source_key(method: str, source: str) -> str:
    """What one source's drafts are accepted at within a method that picks among several
    (hybrid, auto): the engine records each step under it (Drafts.keys)."""
    return f"{method}:{source}"


class Proposer(ABC):
    name: str
    # the drafter reports each draft's confidence to a DraftGate (runtime/speculation/draft_length.py) and
    # stops a stream's drafting where the gate says so (`--num-draft-tokens auto`)
    gated: bool = False
    # The target's per-token output this proposer drafts from ("hidden_states",
    # "eagle3_features"); the engine passes its rows to `observe`. None: token ids only.
    reads: str | None = None

    @abstractmethod
    def propose(self, streams: list, ks: list[int], gate=None) -> Drafts:
        """Drafts up to ks[i] tokens to follow each stream's tokens (prompt + output). gate
        (DraftGate, for a `gated` proposer): after each draft of stream i, gate.more(i, conf)
        says whether to draft another."""

    def observe(self, stream, start: int, rows: np.ndarray) -> None:
        """The target's `reads` output for the stream's positions [start, start + len(rows)),
        rows [n, D]: after prefill, and after each verification for the accepted positions."""

    def commit(self, stream) -> None:
        """Called after the stream's output grew: drop state built on rejected drafts."""

    def release(self, stream) -> None:
        """Called when the stream finishes and its slot is freed."""

    def adopt(self, stream, src: int, n: int, owner: int) -> int:
        """The stream starts from the target's cache rows [0, n) of slot `src` (its own slot,
        or one they were copied from into it), written by the stream `owner` (prefix caching,
        runtime/prefix_cache.py). -> the first position whose target rows this proposer must
        be handed (`observe`), at most n: n for one that reads token ids only; a drafter
        with caches of its own follows the target's rows, or asks for every row (0)."""
        return 0 if self.reads else n


class DraftVocab:
    """A drafter head over part of the target's vocabulary (Eagle3's; the MTP, Eagle and
    vanilla heads exported with --draft-vocab): draft id d is target id d + d2t[d]."""

    def __init__(self, d2t: np.ndarray, vocab_size: int):
        """d2t: [draft_vocab] int64, EAGLE's layout; vocab_size: the target's."""
        self.draft_to_target = np.arange(len(d2t), dtype=np.int64) + d2t  # [draft_vocab]
        if len(d2t) and not (0 <= self.draft_to_target.min()
                             and self.draft_to_target.max() < vocab_size):
            raise ValueError(f"d2t maps draft ids outside the target vocabulary "
                             f"0..{vocab_size - 1}")
        if len(np.unique(self.draft_to_target)) != len(d2t):
            raise ValueError("d2t maps two draft ids to one target id")
        self.vocab_size = vocab_size

    def __len__(self) -> int:
        return len(self.draft_to_target)

    def to_target(self, q_draft: np.ndarray) -> np.ndarray:
        """q_draft [draft_vocab] -> q [vocab]: placed at the mapped target ids, zero elsewhere."""
        q = np.zeros(self.vocab_size, dtype=q_draft.dtype)
        q[self.draft_to_target] = q_draft
        return q


def pick_draft(s, logits: np.ndarray, vocab: DraftVocab | None = None,
               drafted=()) -> tuple[int, np.ndarray | None]:
    """A draft token from a drafter's logits [head_vocab] (over `vocab`, or the target's whole
    vocabulary when None) -> (target token, q [vocab] or None when greedy). drafted: the
    tokens this stream drafted before it this step. Greedy: the argmax. Sampling: the race
    (`draw`) over q, the head's distribution after the request's controls
    (runtime/sampling.py, with the same context as the target's row that verifies it: the
    output so far and `drafted`); over a draft vocabulary q is placed at its target ids
    (zero elsewhere), so the race's noise is the target's, id for id. Under a grammar the
    logits are held to what it allows first (`held`), so q is the masked, renormalised
    distribution drawn from."""
    logits = held(s, logits, vocab, drafted)
    if s.params.processes_logits:
        return pick_processed(s, logits, vocab, drafted)
    if s.params.greedy:
        d = int(np.argmax(logits))
        return (d if vocab is None else int(vocab.draft_to_target[d])), None
    q = probs(logits, s.params)
    if vocab is not None:
        q = vocab.to_target(q)
    return draw(s, q, drafted), q


def draw(s, q: np.ndarray, drafted) -> int:
    """The draft token from q [vocab] (over the target's ids): the race of the stream's seed
    at the output position it drafts (runtime/race.py), the target's own noise there, so that
    the draft equals the target's token there as often as the coupling allows
    (runtime/verify.py)."""
    return race(q, s.params.seed, len(s.output_ids) + len(drafted))


def held(s, logits: np.ndarray, vocab: DraftVocab | None, drafted) -> np.ndarray:
    """A drafter's logits [head_vocab] with what the stream's grammar does not allow after
    its output and `drafted` set to -inf (over a draft vocabulary: by its target ids), so a
    model drafter drafts within the structure, its grammar state advanced along the draft.
    Unchanged without a steering grammar, or where it allows none of the head's tokens (the
    engine then cuts the draft: runtime/guided_step.py)."""
    guide = s.guide
    if guide is None or not guide.steer:
        return logits
    allowed = guide.allowed(drafted)
    if allowed is None:
        return logits
    if vocab is not None:
        allowed = allowed[vocab.draft_to_target]
    if not allowed.any():
        return logits
    return np.where(allowed, logits, -np.inf).astype(logits.dtype, copy=False)


def pick_processed(s, logits: np.ndarray, vocab: DraftVocab | None,
                   drafted) -> tuple[int, np.ndarray | None]:
    """pick_draft under logit_bias or penalties: they are indexed by target ids, so a draft
    vocabulary's logits are placed over the target's (-inf elsewhere) and processed there."""
    if vocab is not None:
        full = np.full(vocab.vocab_size, -np.inf)
        full[vocab.draft_to_target] = logits
        logits = full
    z = process_logits(logits[None], s.params, s.prompt_ids, [*s.output_ids, *drafted])[0]
    if s.params.greedy:
        return int(np.argmax(z)), None
    q = probs(z, s.params)
    return draw(s, q, drafted), q


def confidence(logits: np.ndarray, q: np.ndarray | None, token: int) -> float:
    """The drafter's probability of the token it drafted: q[token] when sampled (q over the
    target vocabulary), else the softmax maximum of its logits [head_vocab] (greedy)."""
    if q is not None:
        return float(q[token])
    return float(1.0 / np.exp(logits - logits.max()).sum())
