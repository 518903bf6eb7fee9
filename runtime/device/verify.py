"""Speculative verification in torch, written once: runtime/verify.py's rule (the terms
accepted, recovered and bonus, p = target, q = draft, are defined there), batched with fixed
shapes and no host round trip. The device loop (runtime/device/loop.py: captured in a CUDA
graph) and the SpecVerify op (plugins/spec_verify.py: the TensorRT plugin's torch form, its
ONNX Runtime lowering, and what its Triton kernel is held to) both call `verify`.

    target token at row i   greedy rows: argmax(logits[i]); sampled rows: the exponential
                            race of the row's seed at output position position + i over p_i
                            (runtime/race.py; race_torch.race_logits: the same noise, bit for
                            bit, taken in the log domain)
    accepted                the longest draft prefix equal to the target's tokens
    emitted                 the accepted drafts, then the target's token after them (the
                            recovered token at a mismatch, the bonus token after k)

So the tokens are the host's verify_batch's (runtime/verify.py race_verify), token for token
on the same logits, and plain decoding's for a seed whatever was drafted: no q is read (a
model drafter couples by drawing its draft with the same noise, runtime/device/drafters.py).
A draft slot marked invalid (an n-gram lookup that found fewer than k tokens) is never
accepted. p is taken in float64, as the host takes it.
"""

from __future__ import annotations

import torch

from trt_spec.runtime.race_torch import race_logits
from trt_spec.runtime.sampling_torch import filter_logits, temperature_or_one
from trt_spec.runtime.verify import PLACEHOLDER


def target_tokens(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor | None,
                  top_p: torch.Tensor | None, greedy: torch.Tensor, seed: torch.Tensor,
                  position: torch.Tensor, any_sampled: bool = True,
                  ids: torch.Tensor | None = None, vocab: int | None = None) -> torch.Tensor:
    """The token of each row: logits [B, R, V'], temperature / top_k / top_p / greedy / seed [B]
    (top_k, top_p None: no row filters, a sort less), position [B, R] (output positions) ->
    [B, R]: the argmax on greedy rows, the race of (seed, position) over p elsewhere.
    any_sampled False: every row is greedy (no noise drawn). ids [V'] / vocab: the columns'
    ids in a vocabulary of `vocab` (a drafter's draft vocabulary: race_logits); the result is
    a column index."""
    argmax = logits.argmax(-1)  # (B, R)
    if not any_sampled:
        return argmax
    t = temperature_or_one(temperature, greedy).to(torch.float64)
    z = filter_logits(logits.to(torch.float64) / t.view(-1, 1, 1), top_k, top_p)  # (B, R, V')
    raced = race_logits(z, seed, position, logits.shape[-1] if vocab is None else vocab, ids)
    return torch.where(greedy[:, None], argmax, raced)


def verify(drafts: torch.Tensor, valid: torch.Tensor, target_logits: torch.Tensor,
           temperature: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None,
           greedy: torch.Tensor, seed: torch.Tensor, position: torch.Tensor,
           any_sampled: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """drafts [B, k] int64; valid [B, k] bool (a prefix per row); target_logits [B, W, V] with
    W >= k + 1 (row i verifies drafts[:, i], row k gives the bonus token); temperature (> 0;
    greedy rows: any) / greedy / seed (uint64 bits as int64) [B]; top_k / top_p [B] or None
    (no row filters); position [B]: the output position row 0 predicts (the output's
    length). any_sampled False: every row is greedy.

    -> (tokens [B, k + 1]: accepted drafts, then the recovered or bonus token, then
    PLACEHOLDER; num_accepted [B])."""
    batch, k = drafts.shape
    cols = torch.arange(k + 1, device=drafts.device)
    target = target_tokens(target_logits[:, :k + 1], temperature, top_k, top_p, greedy, seed,
                           position[:, None] + cols, any_sampled)  # (B, k+1)
    ok = (drafts == target[:, :k]) & valid  # (B, k)
    # accepted: the drafts before the first miss (a cumsum: ONNX has no CumProd)
    accepted = (torch.cumsum((~ok).to(torch.int64), 1) == 0).to(torch.int64).sum(1)  # (B,)
    # an accepted draft is the target's token: row j emits target[j] up to the accepted one
    keep = cols[None] <= accepted[:, None]
    return torch.where(keep, target, torch.full_like(target, PLACEHOLDER)), accepted
