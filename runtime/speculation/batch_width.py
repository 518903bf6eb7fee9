"""The batch-level check after drafting: how many draft rows the whole step verifies.

Every stream of a step waits for all of it, and a step is as dear as its widest request: at
batch 8 on a CPU one stream verifying 4 drafts makes all 8 pay for 5 rows. The policy judges
each stream alone, before it drafts; this judges the step, with the drafts in hand (their
drafting is spent; only verification is left to weigh):

    w* = argmax over w in 0 .. widest of  E(w) / (c_B(w + 1) / c_B(1))
         E(w) = sum over streams of 1 + sum_{j < min(len(d_s), w)} a_s(j)

a_s(j): the acceptance by position its drafts are measured at (per method, per source within
hybrid / auto, per sampling mode). w* = 0 is a plain step for everyone: its tokens per unit
of cost are B. Drafts are cut to w* (a cut draft is as a rejected one: no proposer state
depends on it being verified); one step in PROBE_EVERY that would be cut keeps one draft
more, so the next position stays measured. Only under the gain rules, from 2 streams on.
"""

from __future__ import annotations

from trt_spec.runtime.speculation.draft_length import DraftLength, PositionAcceptance

PROBE_EVERY = 16


class BatchWidth:
    def __init__(self):
        self.cuts = 0  # steps that would have been cut, for the probes

    def width(self, rule: DraftLength, lengths: list[int],
              acceptance: list[PositionAcceptance | None]) -> int:
        """w*: lengths[i] the drafts of stream i, acceptance[i] what they are accepted at
        (None: a stream without a drafter)."""
        widest = max(lengths, default=0)
        if widest == 0:
            return 0
        batch = len(lengths)
        best_w, best = 0, float(batch)  # plain: B tokens for one plain step
        for w in range(1, widest + 1):
            tokens = batch + sum(acc.rate(j) for n, acc in zip(lengths, acceptance)
                                 if acc is not None for j in range(min(n, w)))
            gain = tokens / rule.costs.ratio(w + 1, batch)
            if gain > best:
                best_w, best = w, gain
        if best_w < widest:
            self.cuts += 1
            if self.cuts % PROBE_EVERY == 1:
                return best_w + 1  # the next position stays measured (policy.py: probes)
        return best_w
