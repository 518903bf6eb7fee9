"""A stream's own part of a step, after the forward its batch shares (runtime/engine.py):
its verification, and the isolation that makes its failure its own.

    isolated(s, release, work)    work() for s; an exception fails s alone: finish_reason
                                  "error" with the exception on s.error, its slot freed
                                  without keeping its rows; the step goes on for the others
    verify_stream(s, draft, rows) s's accepted prefix and one token more (runtime/verify.py),
                                  or, without a draft, its next token as plain decoding's

Work the batch shares (a forward, a proposer's call) is not isolated: its error fails the
step (runtime/scheduler.py). A stream's grammar, which runs in the shared loops of
runtime/guided_step.py, keeps its exception on Stream.fault; verify_stream raises it again
here, where it fails that stream alone.
"""

from __future__ import annotations

import logging
from typing import Callable, TypeVar

import numpy as np

from trt_spec.runtime.sampling import NonFiniteError, next_token
from trt_spec.runtime.speculation.draft import Draft
from trt_spec.runtime.speculation.planner import Verified
from trt_spec.runtime.stream import Stream, controlled, fail
from trt_spec.runtime.verify import greedy_verify, verify_batch

log = logging.getLogger("trt_spec.engine")
T = TypeVar("T")
FAILED = Verified(0, 0, [])  # the outcome of a stream that failed its verification


def isolated(s: Stream, release: Callable[..., None], work: Callable[..., T], *args) -> T | None:
    """work(*args): s's own part of a step (its rows under its controls, its sampling and
    verification, its commit), or None when it raised: s then ends with finish_reason
    "error" (the exception on s.error) and release(s, keep=False) frees its slot without
    keeping its rows, as if s had not been in the step."""
    try:
        return work(*args)
    except Exception as e:  # noqa: BLE001 - one stream's failure is its own
        if isinstance(e, NonFiniteError):
            log.warning("stream %s failed: %s", s.id, e)
        else:
            log.exception("stream %s failed", s.id)
        fail(s, e)
        release(s, keep=False)
        return None


def verify_stream(s: Stream, d: Draft, logits: np.ndarray) -> Verified:
    """A stream that drafted: its accepted prefix and one token more (runtime/verify.py); one
    that did not takes the target's next token as plain decoding samples it (the same race
    at the same position as verifying no drafts). Its rows, logits [len(d) + 1, vocab],
    are under its sampling controls, each counting the drafts before it (stream.controlled);
    a greedy stream without controls reads them as they are, once, and only up to its first
    mismatch (verify.py greedy_verify): the same tokens, a third of the time on SmolLM2."""
    if s.fault is not None:  # raised for s in the step's shared work (its grammar)
        raise s.fault
    if s.params.greedy and not s.params.processes_logits:  # one pass, up to the first miss
        accepted, tokens = greedy_verify(d.tokens, logits[len(logits) - len(d) - 1:])
        return Verified(len(d), accepted, tokens)
    at = len(s.output_ids)  # the output position of its first row
    if not len(d):
        return Verified(0, 0, [next_token(controlled(s, logits[-1:])[0], s.params, at)])
    out = verify_batch([d.tokens], [controlled(s, logits, d.tokens)], [s.params], [at])
    return Verified(len(d), int(out.num_accepted[0]), out.tokens[0, :out.num_emitted[0]])
