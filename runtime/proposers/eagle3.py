"""Eagle3 proposer: Eagle's loop over a head that reads the target's fused low/mid/high
features (through fc, on the first step only) and drafts over a reduced vocabulary.

    first step   hidden = fc(eagle3_features rows)          (one call for every stream)
    every step   logits over the draft vocabulary; target id = draft id + d2t[draft id]

The draft vocabulary's mapping (greedy and sampled) is base.pick_draft's, shared with the
MTP, Eagle and vanilla heads exported with --draft-vocab.
"""

from __future__ import annotations

import numpy as np

from trt_spec.runtime.backends.base import Function, StepGraph
from trt_spec.runtime.kv_cache import KVCache
from trt_spec.runtime.proposers.base import DraftVocab
from trt_spec.runtime.proposers.mtp import MtpProposer


class Eagle3Proposer(MtpProposer):
    name = "eagle3"
    gated = True
    reads = "eagle3_features"

    def __init__(self, step: StepGraph, cache: KVCache, fc: Function, vocab: DraftVocab):
        super().__init__([step], [cache], vocab)
        self.fc = fc

    def first_hidden(self, rows: list[np.ndarray]) -> list[np.ndarray]:
        if not rows:
            return []
        fused = self.fc(np.concatenate(rows)[None].astype(np.float32))[0]  # (sum r_i, H)
        return np.split(fused, np.cumsum([len(r) for r in rows])[:-1])
