"""A decode step under structured outputs (runtime/grammar.py): drafts the grammar forces,
drafts held to what it allows, and the bitmasks of the rows the target verifies.

Each function loops over the step's streams; what one stream's grammar raises (a limit of
the grammar engine passed, a bug) is kept on that stream (Stream.fault: `guarded`), which
then drafts nothing and fails alone in its own part of the step
(runtime/stream_step.py verify_stream), so the other streams of the step go on."""

from __future__ import annotations

import numpy as np

from trt_spec.runtime.speculation.draft import Draft
from trt_spec.runtime.stream import StepMetrics


def guarded(s, work, *args):
    """work(*args) for stream s, or None when it raises: the exception is kept on s.fault
    (the first one) and raised again in s's own part of the step."""
    if s.fault is not None:
        return None
    try:
        return work(*args)
    except Exception as e:  # noqa: BLE001 - one stream's grammar fails that stream alone
        s.fault = e
        return None


def forced_drafts(streams: list, ks: list[int], limit: int, room) -> dict[int, np.ndarray]:
    """Per stream under a grammar that allows exactly one continuation from here: those
    tokens (at most `limit`, SpeculationConfig.forced_tokens, and room(s)), drafted for free;
    its own drafter sits this step out (ks[i] = 0)."""
    forced = {}
    for i, s in enumerate(streams):
        if s.guide is not None and limit:
            tokens = guarded(s, forced_tokens, s, min(limit, room(s)))
            if tokens:
                forced[i] = np.asarray(tokens, dtype=np.int64)
            if tokens or s.fault is not None:  # (a faulted stream drafts nothing)
                ks[i] = 0
    return forced


def forced_tokens(s, limit: int) -> list[int]:
    tokens = s.guide.forced(limit)
    return tokens[:s.guide.valid(tokens)]  # as the mask allows them


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
        guarded(s, hold, s, drafts[i], planner)
        if s.fault is not None:
            drafts[i].cut(0)


def hold(s, d: Draft, planner) -> None:
    """s's draft d, cut or extended by its grammar (hold_to_grammar)."""
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
            bits = guarded(s, row_masks, s, drafts[i].tokens)
            if bits is not None:  # (a faulted stream fails before its rows are read)
                out[i] = bits
    return out


def row_masks(s, tokens) -> np.ndarray:
    return s.guide.masks(tokens[:s.guide.valid(tokens)])


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
