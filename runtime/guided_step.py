"""A decode step under structured outputs (runtime/grammar.py): drafts the grammar forces,
drafts held to what it allows, and the bitmasks of the rows the target verifies."""

from __future__ import annotations

import numpy as np

from trt_spec.runtime.speculation.draft import Draft
from trt_spec.runtime.stream import StepMetrics


def forced_drafts(streams: list, ks: list[int], limit: int, room) -> dict[int, np.ndarray]:
    """Per stream under a grammar that allows exactly one continuation from here: those
    tokens (at most `limit`, SpeculationConfig.forced_tokens, and room(s)), drafted for free;
    its own drafter sits this step out (ks[i] = 0)."""
    forced = {}
    for i, s in enumerate(streams):
        if s.guide is not None and limit:
            tokens = s.guide.forced(min(limit, room(s)))
            tokens = tokens[:s.guide.valid(tokens)]  # as the mask allows them
            if tokens:
                forced[i] = np.asarray(tokens, dtype=np.int64)
                ks[i] = 0
    return forced


def hold_to_grammar(streams: list, drafts: list[Draft], forced: dict[int, np.ndarray],
                    planner=None) -> None:
    """Forced tokens become their streams' drafts; a drafter's drafts are cut where the
    grammar stops allowing them. A sampled draft with a distribution keeps its first
    disallowed token: verification rejects it for certain and samples that position from
    the residual max(0, p - q), which keeps the output distribution exact (cutting it would
    sample from p instead). A draft the grammar allows whole is followed by the run the
    grammar forces after it (planner: its forced_tokens limit and each stream's room), free:
    accepted whenever the draft is (the target, masked, allows nothing else there)."""
    for i, s in enumerate(streams):
        if s.guide is None:
            continue
        if i in forced:
            drafts[i] = Draft.forced(forced[i])
            continue
        d = drafts[i]
        n = s.guide.valid(d.tokens)
        if n < len(d):
            d.cut(n + 1 if d.q is not None and not s.params.greedy else n)
        elif len(d) and planner is not None:
            limit = min(planner.config.forced_tokens, planner.room(s) - len(d))
            d.extend_forced(s.guide.forced_after(d.tokens, limit))


def masks(streams: list, drafts: list[Draft]) -> dict[int, np.ndarray]:
    """Per guided stream, its grammar's bitmasks for the rows it verifies: before each
    allowed draft and after the last (all of its drafts, or all but a kept rejected one).
    llguidance drops the GIL, so this runs beside the target's forward."""
    out = {}
    for i, s in enumerate(streams):
        if s.guide is not None:
            tokens = drafts[i].tokens
            out[i] = s.guide.masks(tokens[:s.guide.valid(tokens)])
    return out


def apply_masks(streams: list, bits: dict[int, np.ndarray], logits: list[np.ndarray],
                m: StepMetrics) -> dict[int, np.ndarray]:
    """Masks, in place, each guided stream's rows of logits by its bitmasks. Returns the
    logits as they were for the streams that report logprobs."""
    raw = {}
    for i, b in bits.items():
        guide = streams[i].guide
        before = guide.mask_s
        if streams[i].params.logprobs is not None:
            raw[i] = logits[i].copy()
        guide.apply(logits[i], b)
        m.mask_s += guide.mask_s - before
    return raw
