"""Speculative verification on the device, in torch: runtime/verify.py's rules (the terms
accepted, recovered and bonus, p = target, q = draft, are defined there), batched with fixed
shapes and no host round trip, so the device loop (runtime/device/loop.py) can capture it in a
CUDA graph.

    greedy rows      accept the longest prefix where draft == argmax(target); then argmax
    sampled rows     accept draft x with probability min(1, p(x) / q(x)); on the first
                     rejection a recovered token from norm(max(0, p - q)); after k accepted
                     drafts a bonus token from p (Leviathan et al. 2023, Algorithm 1)

A draft slot marked invalid (an n-gram lookup that found fewer than k tokens) is never
accepted; its q is one-hot on a token p gives no mass to, so the recovered token is drawn
from p itself, as plain sampling would.

p is runtime/sampling_torch.py's probs_from_logits (the host rule, batched per row), and
tokens are drawn by its exponential race (no cumsum, sort or host sync).
"""

from __future__ import annotations

import torch

from trt_spec.runtime.sampling_torch import probs_from_logits, race, temperature_or_one
from trt_spec.runtime.verify import Q_FLOOR  # q(x) is never below this in a division


def verify(drafts: torch.Tensor, valid: torch.Tensor, draft_probs: torch.Tensor | None,
           target_logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
           top_p: torch.Tensor, greedy: torch.Tensor, any_sampled: bool, filtered: bool,
           generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """drafts [B, k] int64; valid [B, k] bool (a prefix per row); draft_probs [B, k, V] q at
    each draft position, or None (a deterministic drafter: q one-hot); target_logits
    [B, W, V] with W >= k + 1 (row i verifies drafts[:, i], row k gives the bonus token);
    temperature / top_k / top_p / greedy [B]. any_sampled: some row samples (False: the
    greedy path only, no probabilities). filtered: some row uses top-k or top-p (False:
    neither is applied, a sort less).

    -> (tokens [B, k + 1]: accepted drafts, then the recovered or bonus token, then
    whatever; num_accepted [B])."""
    batch, k = drafts.shape
    logits = target_logits[:, :k + 1]  # (B, k+1, V)
    argmax = logits.argmax(-1)  # (B, k+1)
    cols = torch.arange(k + 1, device=drafts.device)
    if not any_sampled:
        ok = (drafts == argmax[:, :k]) & valid  # (B, k)
        accepted = ok.long().cumprod(-1).sum(-1)  # (B,) the longest matching prefix
        tokens = torch.cat([drafts, argmax[:, k:]], dim=1)  # (B, k+1)
        last = argmax.gather(1, accepted[:, None])  # (B, 1) the target's token after them
        return torch.where(cols[None] == accepted[:, None], last, tokens), accepted
    t = temperature_or_one(temperature, greedy)
    p = probs_from_logits(logits, t, top_k if filtered else None,
                          top_p if filtered else None)  # (B, k+1, V)
    x = drafts.clamp(min=0)
    p_x = p[:, :k].gather(-1, x[..., None])[..., 0]  # (B, k)
    if draft_probs is None:
        q_x = torch.ones_like(p_x)
    else:
        q_x = draft_probs.gather(-1, x[..., None])[..., 0].clamp(min=Q_FLOOR)
    u = torch.rand(p_x.shape, device=p_x.device, generator=generator)
    ok_sampled = u < p_x / q_x
    ok = torch.where(greedy[:, None], drafts == argmax[:, :k], ok_sampled) & valid
    accepted = ok.long().cumprod(-1).sum(-1)  # (B,)
    # the distribution of the token after the accepted prefix, at every position: the
    # residual norm(max(0, p - q)) at a draft position, p at the bonus position
    if draft_probs is None:
        q = torch.nn.functional.one_hot(x, p.shape[-1]).to(p.dtype) * valid[..., None]
    else:
        q = draft_probs.to(p.dtype) * valid[..., None]
    r = torch.cat([(p[:, :k] - q).clamp(min=0), p[:, k:]], dim=1)  # (B, k+1, V)
    mass = r.sum(-1, keepdim=True)
    r = torch.where(mass > 1e-12, r, p)  # no residual mass only when p == q: p itself
    pick = torch.gather(r, 1, accepted[:, None, None].expand(-1, 1, r.shape[-1]))[:, 0]
    sampled = race(pick, generator)  # (B,)
    greedy_next = argmax.gather(1, accepted[:, None])[:, 0]
    nxt = torch.where(greedy, greedy_next, sampled)  # (B,)
    tokens = torch.cat([drafts, argmax[:, k:]], dim=1)
    return torch.where(cols[None] == accepted[:, None], nxt[:, None], tokens), accepted
