"""Eagle proposer: one module of the MTP structure, run in a loop (always module 0).

Step 1 reads the target's hidden state at the anchor row; every later step reads the
module's own hidden state of the row before and the token it just drafted (MtpProposer with
one module: its loop is exactly this)."""

from __future__ import annotations

from trt_spec.runtime.backends.base import StepGraph
from trt_spec.runtime.kv_cache import KVCache
from trt_spec.runtime.proposers.base import DraftVocab
from trt_spec.runtime.proposers.mtp import MtpProposer


class EagleProposer(MtpProposer):
    name = "eagle"
    gated = True

    def __init__(self, module: StepGraph, cache: KVCache, vocab: DraftVocab | None = None):
        super().__init__([module], [cache], vocab)
