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

Tokens are drawn by the exponential race: argmax(r / E), E ~ Exp(1) i.i.d., picks token x with
probability r(x) / sum(r), with no cumsum or sort and no host sync.
"""

from __future__ import annotations

import torch

Q_FLOOR = 1e-10  # q(x) is never below this in a division (runtime/verify.py's)


def probs_from_logits(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                      top_p: torch.Tensor, filtered: bool = True) -> torch.Tensor:
    """logits [B, R, V] -> probabilities [B, R, V] (float32) after each row's temperature
    [B] (> 0), top-k [B] (0: off) and top-p [B] (1: off), runtime/sampling.py's rule: top-k
    keeps the k largest, top-p the smallest set whose mass reaches p. filtered=False skips
    the sort (no row uses top-k or top-p: the caller knows from the host settings)."""
    x = logits.float() / temperature[:, None, None]
    if not filtered:
        return torch.softmax(x, dim=-1)
    vocab = x.shape[-1]
    sorted_x, order = torch.sort(x, dim=-1, descending=True)  # (B, R, V)
    rank = torch.arange(vocab, device=x.device)
    k = torch.where(top_k > 0, top_k.clamp(max=vocab), vocab)  # (B,)
    keep_sorted = rank[None, None, :] < k[:, None, None]  # top-k, in sorted order
    p_sorted = torch.softmax(sorted_x.masked_fill(~keep_sorted, float("-inf")), dim=-1)
    # top-p: keep a token if the mass before it is < top_p (the first token always stays)
    keep_sorted = keep_sorted & ((torch.cumsum(p_sorted, -1) - p_sorted) < top_p[:, None, None])
    keep = torch.zeros_like(keep_sorted).scatter_(-1, order, keep_sorted)
    return torch.softmax(x.masked_fill(~keep, float("-inf")), dim=-1)


def race(r: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """r [..., V] nonnegative weights -> one index per row [...], with probability r / sum(r)."""
    e = torch.empty_like(r).exponential_(generator=generator)
    return (r / e).argmax(-1)


def sample(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
           top_p: torch.Tensor, greedy: torch.Tensor, filtered: bool = True,
           generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row: logits [B, R, V] -> (tokens [B, R], probs [B, R, V]); greedy [B]
    rows take the argmax (their probs are one-hot)."""
    t = torch.where(greedy, torch.ones_like(temperature), temperature)
    p = probs_from_logits(logits, t, top_k, top_p, filtered)
    argmax = logits.argmax(-1)  # (B, R)
    onehot = torch.nn.functional.one_hot(argmax, logits.shape[-1]).to(p.dtype)
    p = torch.where(greedy[:, None, None], onehot, p)
    return torch.where(greedy[:, None], argmax, race(p, generator)), p


def verify(drafts: torch.Tensor, valid: torch.Tensor, draft_probs: torch.Tensor | None,
           target_logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
           top_p: torch.Tensor, greedy: torch.Tensor, any_sampled: bool, filtered: bool,
           generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """drafts [B, k] int64; valid [B, k] bool (a prefix per row); draft_probs [B, k, V] q at
    each draft position, or None (a deterministic drafter: q one-hot); target_logits
    [B, W, V] with W >= k + 1 (row i verifies drafts[:, i], row k gives the bonus token);
    temperature / top_k / top_p / greedy [B]. any_sampled: some row samples (False: the
    greedy path only, no probabilities).

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
    t = torch.where(greedy, torch.ones_like(temperature), temperature)
    p = probs_from_logits(logits, t, top_k, top_p, filtered)  # (B, k+1, V)
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
