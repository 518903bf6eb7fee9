"""Eagle3 proposer: Eagle's loop over a head that reads the target's fused low/mid/high
features (through fc, on the first step only) and drafts over a reduced vocabulary.

    first step   hidden = fc(eagle3_features rows)          (one call for every stream)
    every step   logits over the draft vocabulary; target id = draft id + d2t[draft id]

When sampling, q is the head's distribution over the draft vocabulary (after the request's
temperature / top-k / top-p) placed at the mapped target ids, zero elsewhere: the verifier
then accepts d with min(1, p(d)/q(d)) and resamples from norm(max(0, p - q)), lossless.
"""

from __future__ import annotations

import numpy as np

from trt_spec.runtime.backends.ort import OrtFunction, OrtTarget
from trt_spec.runtime.kv_cache import KVCache
from trt_spec.runtime.proposers.mtp import MtpProposer
from trt_spec.runtime.sampling import probs_from_logits, sample_from_probs


class Eagle3Proposer(MtpProposer):
    name = "eagle3"
    reads = "eagle3_features"

    def __init__(self, step: OrtTarget, cache: KVCache, fc: OrtFunction, d2t: np.ndarray,
                 vocab_size: int):
        super().__init__([step], [cache])
        self.fc = fc
        self.draft_to_target = np.arange(len(d2t), dtype=np.int64) + d2t  # [draft_vocab]
        assert self.draft_to_target.min() >= 0 and self.draft_to_target.max() < vocab_size
        self.vocab_size = vocab_size

    def first_hidden(self, rows: list[np.ndarray]) -> list[np.ndarray]:
        if not rows:
            return []
        fused = self.fc(np.concatenate(rows)[None].astype(np.float32))[0]  # (sum r_i, H)
        return np.split(fused, np.cumsum([len(r) for r in rows])[:-1])

    def pick(self, s, logits: np.ndarray) -> tuple[int, np.ndarray | None]:
        """logits [draft_vocab] -> (target token, q [vocab] or None when greedy)."""
        if s.params.greedy:
            return int(self.draft_to_target[np.argmax(logits)]), None
        q_draft = probs_from_logits(logits, s.params.temperature, s.params.top_k, s.params.top_p)
        q = np.zeros(self.vocab_size, dtype=q_draft.dtype)
        q[self.draft_to_target] = q_draft
        return int(self.draft_to_target[sample_from_probs(q_draft, s.rng)]), q
