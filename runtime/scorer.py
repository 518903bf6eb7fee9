"""The scorer: one target forward over [last token, d1..dk] for every stream in the batch.

The last token is the one sampled last step and not yet in the target's cache; its logits
verify d1, d1's verify d2, ..., dk's give the bonus token. Rows may differ in k (k = 0 is a
plain decode step), so speculating and non-speculating streams share the forward.
"""

from __future__ import annotations

import numpy as np

from trt_spec.runtime.backends.base import StepGraph, StepOutput
from trt_spec.runtime.kv_cache import KVCache
from trt_spec.runtime.step_inputs import SlotTokens


class Scorer:
    def __init__(self, target: StepGraph, cache: KVCache):
        self.target = target
        self.cache = cache

    def score(self, streams, drafts: list[np.ndarray], reads: tuple[str, ...] = ()) -> StepOutput:
        """Per stream target logits [k_i + 1, vocab] (and the rows of each `reads` output). The
        target cache grows by k_i + 1 rows; `rewind` after sampling keeps the accepted ones."""
        requests = []
        for s, d in zip(streams, drafts):
            tokens = [s.output_ids[-1]] + [int(t) for t in d]
            requests.append(SlotTokens(s.slot, tokens, list(range(len(tokens)))))
        if len(requests) == 1 and not reads:  # one stream, nothing kept past the step: the
            # target's bound-once step (its logits a view the next such step overwrites)
            logits = self.target.decode_rows(self.cache, requests[0].slot, requests[0].tokens)
            if logits is not None:
                return StepOutput([logits], {})
        return self.target.step(self.cache, requests, reads)

    def rewind(self, s) -> None:
        """The cache holds everything but the stream's last (not yet scored) token."""
        self.cache.rewind(s.slot, len(s.prompt_ids) + len(s.output_ids) - 1)
