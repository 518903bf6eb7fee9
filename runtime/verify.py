"""Speculative verification: which drafted tokens to keep, and the token that follows them.

Terms, used throughout:
    p            the target's next-token distribution at a position (after the sampling
                 controls, runtime/sampling.py: process_logits with the row's own context,
                 the output so far and the drafts before it, then temperature, min-p, top-k
                 and top-p; applied exactly as for q)
    q            the drafter's distribution the draft token was drawn from; a deterministic
                 drafter (n-gram, greedy draft) has q = one-hot of its token
    accepted     a drafted token the verifier keeps; drafts are kept as a prefix
    recovered    the token emitted in place of the first rejected draft
    bonus        the token emitted after all k drafts were accepted
Every step therefore emits accepted + 1 tokens.

Greedy: accept the longest prefix where the draft equals the target's argmax; the recovered
or bonus token is the target's argmax.

Sampled (drafter-invariant; Daliri, Musco and Suresh 2024, "Coupling without Communication
and Drafter-Invariant Speculative Decoding"): the target's token at output position i is
the exponential race of the request's seed at i over p (runtime/race.py), t_i = argmin_v
E(s, i, v) / p(v), a fixed function of (s, i) and p. Accept the longest prefix where the
draft equals t_i; the recovered or bonus token is t_i. Plain decoding emits t_i at i too, so
every method and k emits exactly plain decoding's tokens for a seed, and the emitted tokens
are distributed as p (the race's marginal). A lookup's draft x is accepted with probability
p(x), as under Leviathan's rule; a model drafter draws its draft at i as the race of the
same noise over q (runtime/proposers/base.py pick_draft), which makes it agree with t_i with
probability at least (1 - TV(p, q)) / (1 + TV(p, q)) (Leviathan's rule: 1 - TV(p, q)).

The device loop and the SpecVerify op verify by the same rule, in torch
(runtime/device/verify.py), token for token with `verify_batch` on the same logits.

Leviathan et al. 2023 ("Fast Inference from Transformers via Speculative Decoding",
Algorithm 1: accept x with probability min(1, p(x) / q(x)), else draw the recovered token
from norm(max(0, p - q))) is kept as `stochastic_verify`: no loop runs it any more; it is the
rule a model drafter's acceptance under the race is compared with (it does not reproduce a
seed across methods).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from trt_spec.runtime.sampling import (NonFiniteError, SamplingParams, next_token,
                                       sample_from_probs, target_probs)

PLACEHOLDER = -1  # fills fixed-shape token outputs past what a row emitted
Q_FLOOR = 1e-10  # q(x) is never below this in a division


@dataclass
class SampleResult:
    tokens: np.ndarray  # [batch, k_max + 1] int64; row i: tokens[i, :num_emitted[i]], rest PLACEHOLDER
    num_accepted: np.ndarray  # [batch] drafts accepted per row
    num_emitted: np.ndarray  # [batch] = num_accepted + 1


def greedy_verify(drafts, target_logits: np.ndarray) -> tuple[int, list[int]]:
    """drafts: [k]; target_logits: [k + 1, vocab] (row i predicts the token after
    drafts[:i]) -> (accepted, emitted tokens), the target's argmax at each row read. Rows
    are read once each, and only up to the first mismatch; each row read is checked as
    check_finite checks it (NonFiniteError where its maximum is NaN or +inf: np.argmax
    returns the first NaN, so the argmax's value is non-finite exactly there; a row all
    -inf, a grammar's dead end, passes), so a stream without logits controls hands the
    target's rows straight in. The rows after the first mismatch, which nothing reads, are
    not checked: on a CPU they (196 KB each on SmolLM2, just written by the session's
    threads) cost more to read than to compute."""
    out = []
    for i in range(len(drafts) + 1):
        row = target_logits[i]
        t = int(row.argmax())
        top = row[t]
        if top != top or top == np.inf:
            raise NonFiniteError(f"the target's logits are not finite (a row's maximum is "
                                 f"{top}): the model's output overflowed")
        out.append(t)
        if i == len(drafts) or t != int(drafts[i]):
            return i, out
    raise AssertionError("unreachable")  # (the last row always returns)


def residual(p: np.ndarray, q: np.ndarray | None, x: int) -> np.ndarray:
    """norm(max(0, p - q)); q None means one-hot at x. Falls back to p when the residual has
    no mass (p <= q everywhere, which only happens when p == q, where rejection is
    impossible anyway; guards float round-off)."""
    r = p.copy()
    if q is None:
        r[x] = max(0.0, r[x] - 1.0)
    else:
        r = np.maximum(r - q, 0.0)
    total = r.sum()
    return r / total if total > 1e-12 else p


def stochastic_verify(drafts: np.ndarray, draft_probs: np.ndarray | None,
                      target_logits: np.ndarray, params: SamplingParams,
                      rng: np.random.Generator) -> tuple[int, list[int]]:
    """Leviathan's rule (the device loop's; the module docstring). drafts: [k]; draft_probs:
    [k, vocab] (q at each draft position) or None for a deterministic drafter;
    target_logits: [k + 1, vocab] (after process_logits)."""
    def p(i: int) -> np.ndarray:  # row by row: rows after the first rejection are never read
        return target_probs(target_logits[i], params)

    out = []
    for i, x in enumerate(int(d) for d in drafts):
        p_i = p(i)
        q_x = 1.0 if draft_probs is None else max(float(draft_probs[i, x]), Q_FLOOR)
        if rng.random() < p_i[x] / q_x:  # accept with probability min(1, p/q)
            out.append(x)
            continue
        q = None if draft_probs is None else draft_probs[i]
        out.append(sample_from_probs(residual(p_i, q, x), rng))  # recovered token
        return i, out
    out.append(sample_from_probs(p(len(drafts)), rng))  # bonus token
    return len(drafts), out


def race_verify(drafts: np.ndarray, target_logits: np.ndarray, params: SamplingParams,
                position: int) -> tuple[int, list[int]]:
    """drafts: [k]; target_logits: [k + 1, vocab] (after process_logits), row i the target at
    output position position + i. Accepts while a draft equals the target's raced token
    (sampling.next_token); that token ends the step. Rows after the first mismatch are
    never read."""
    out = []
    for i, x in enumerate(int(d) for d in drafts):
        t = next_token(target_logits[i], params, position + i)
        out.append(t)
        if t != x:
            return i, out
    out.append(next_token(target_logits[len(drafts)], params, position + len(drafts)))
    return len(drafts), out


def verify_batch(drafts: list[np.ndarray], target_logits: list[np.ndarray],
                 params: list[SamplingParams], positions: list[int]) -> SampleResult:
    """Per row: drafts [k_i], target_logits [k_i + 1, vocab] (each row after its
    process_logits: runtime/sampling.py), params (sampled: with its seed), positions: the
    output position its first row predicts (its output's length). Rows may have different k
    (k_i = 0 is a plain decode step)."""
    batch = len(drafts)
    k_max = max((len(d) for d in drafts), default=0)
    tokens = np.full((batch, k_max + 1), PLACEHOLDER, dtype=np.int64)
    accepted = np.zeros(batch, dtype=np.int64)
    for i in range(batch):
        d = np.asarray(drafts[i], dtype=np.int64)
        assert target_logits[i].shape[0] == len(d) + 1, (target_logits[i].shape, len(d))
        if params[i].greedy:
            a, out = greedy_verify(d, target_logits[i])
        else:
            a, out = race_verify(d, target_logits[i], params[i], positions[i])
        tokens[i, :len(out)] = out
        accepted[i] = a
    return SampleResult(tokens, accepted, accepted + 1)
