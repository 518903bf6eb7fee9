"""The sampling transforms in torch: runtime/sampling.py's `probs_from_logits`, batched with
one setting per row, for the device loop (runtime/device/) and the SpecVerify op
(plugins/spec_verify.py). The steps, in the same order as the NumPy one:

    mask             vLLM's masks: allowed_token_ids, bad words (matched on each row's
                     output tail and drafts before it), min_tokens (the end tokens while
                     the row's output is short)
    process_logits   logit_bias, then the repetition, frequency and presence penalties over
                     each row's token counts (prompt, output so far, the drafts before it)
    temperature   z = logits / T
    min-p         drop the tokens less likely than min_p times the most likely   0: off
    top-k         keep the k largest z (ties with the k-th kept too)           k = 0: off
    top-p         keep the smallest set of tokens, most likely first, whose
                  probability reaches p (the first token always stays)         p = 1: off
    softmax       probabilities of what is kept (a dropped token's z is -inf)

A new per-request control is one more step function here and one in runtime/sampling.py, at
the same place in the order; tests/test_sampling_torch.py holds the two to each other.

Only the torch backends import this module: the base install (NumPy and ONNX Runtime) has no
torch. It runs inside a CUDA graph: fixed shapes, no host sync, no branch on a tensor's values
(a filter is skipped only when its settings are None, which the caller knows from the host).
Sorting is `torch.topk` (ONNX TopK; Sort has no export), so tracing it is the op's ONNX
Runtime lowering.

Shapes: logits and z [B, R, V] (R positions per row), settings [B].
"""

from __future__ import annotations

import torch

from trt_spec.runtime.sampling import GREEDY_TEMPERATURE


def greedy_as_zero(temperature: torch.Tensor) -> torch.Tensor:
    """temperature [B] -> [B] with every value below GREEDY_TEMPERATURE (1e-5) at 0: greedy,
    as SamplingParams stores it, so an op fed temperatures from elsewhere agrees with the
    host on which rows are greedy (a division by a subnormal one overflows)."""
    return torch.where(temperature < GREEDY_TEMPERATURE, torch.zeros_like(temperature),
                       temperature)


def temperature_or_one(temperature: torch.Tensor, greedy: torch.Tensor) -> torch.Tensor:
    """temperature [B], greedy [B] bool -> [B]: 1 on greedy rows, whose temperature (0) must
    not divide; their tokens are the argmax, and their probabilities unused or one-hot."""
    return torch.where(greedy, torch.ones_like(temperature), temperature)


def row_counts(output_counts: torch.Tensor, drafts: torch.Tensor) -> torch.Tensor:
    """output_counts [B, V] (each token's count in the output so far), drafts [B, k] -> the
    counts row j of a verification [last, d1..dk] sees, [B, k + 1, V]: the output's plus
    d1..dj (runtime/sampling.py's process_logits counts the same)."""
    onehot = torch.nn.functional.one_hot(drafts, output_counts.shape[-1]).to(output_counts.dtype)
    before = torch.cumsum(onehot, 1)  # [B, k, V] d1..dj
    zero = torch.zeros_like(output_counts)[:, None]
    return output_counts[:, None] + torch.cat([zero, before], 1)


def process_logits(logits: torch.Tensor, bias: torch.Tensor | None = None,
                   counts: torch.Tensor | None = None, prompt_seen: torch.Tensor | None = None,
                   repetition: torch.Tensor | None = None, frequency: torch.Tensor | None = None,
                   presence: torch.Tensor | None = None) -> torch.Tensor:
    """logits [B, R, V] -> z [B, R, V] after logit_bias (bias [B, V], 0 where none) and the
    penalties (counts [B, R, V] of each row's output and drafts before it, row_counts;
    prompt_seen [B, V] bool; repetition [B] (1: off), frequency and presence [B] (0: off)).
    bias None: no row has one; counts None: no row penalizes. Computes in the logits' dtype
    promoted to at least float32, as probs_from_logits."""
    z = logits.to(torch.promote_types(logits.dtype, torch.float32))
    if bias is not None:
        z = z + bias.to(z.dtype)[:, None]
    if counts is not None:
        counts = counts.to(z.dtype)
        seen = (counts > 0) | prompt_seen[:, None]
        r = repetition.to(z.dtype).view(-1, 1, 1)
        z = torch.where(seen, torch.where(z > 0, z / r, z * r), z)
        penalty = (frequency.to(z.dtype).view(-1, 1, 1) * counts
                   + presence.to(z.dtype).view(-1, 1, 1) * (counts > 0))
        z = z - penalty
    return z


ANY = -2  # a bad-word head's padding: matches any token (heads are right-aligned)
NONE = -1  # no token: a bad-word table's empty entry, a context before the output's start


def mask_allowed(z: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """z [B, R, V], allowed [B, V] bool (all True: no allowed_token_ids) -> z with every
    token not allowed at -inf."""
    return torch.where(allowed[:, None], z, torch.full_like(z, float("-inf")))


def bad_word_hits(context: torch.Tensor, heads: torch.Tensor, last: torch.Tensor,
                  vocab: int) -> torch.Tensor:
    """The tokens the bad words rule out, [B, R, V] bool. context [B, H + R - 1]: the last H
    output tokens (NONE before the output's start) then the drafts d1..d(R-1); heads
    [B, W, H]: each word but its last token, right-aligned, ANY-padded; last [B, W]: each
    word's last token (NONE: no word). Row j rules out a word's last token when its head ends
    context[:, :H + j] (a one-token word: always), as runtime/sampling.py's mask_."""
    h = heads.shape[-1]
    tails = context.unfold(1, h, 1)  # [B, R, H] row j: context[:, j:j + H]
    hit = ((heads[:, None] == tails[:, :, None]) | (heads[:, None] == ANY)).all(-1)  # [B, R, W]
    hit = hit & ((last >= 0) & (last < vocab))[:, None]
    index = torch.where(hit, last[:, None].expand_as(hit), vocab)  # V: the scratch column
    out = torch.zeros(*hit.shape[:2], vocab + 1, dtype=torch.bool, device=hit.device)
    return out.scatter(-1, index, torch.ones_like(hit))[..., :vocab]


def mask_ends(z: torch.Tensor, ends: torch.Tensor, out_len: torch.Tensor,
              min_tokens: torch.Tensor) -> torch.Tensor:
    """z [B, R, V], ends [B, V] bool (the end tokens: EOS, stop_token_ids), out_len [B] (the
    output so far), min_tokens [B] (0: off) -> z with the end tokens at -inf on the rows j
    whose output, out_len + j, is shorter than min_tokens."""
    rows = torch.arange(z.shape[1], device=z.device)
    short = out_len[:, None] + rows[None] < min_tokens[:, None]  # [B, R]
    return torch.where(short[..., None] & ends[:, None], torch.full_like(z, float("-inf")), z)


def mask(z: torch.Tensor, allowed: torch.Tensor, banned: torch.Tensor, ends: torch.Tensor,
         out_len: torch.Tensor, min_tokens: torch.Tensor) -> torch.Tensor:
    """vLLM's masks in the host's order (runtime/sampling.py process_logits' first steps):
    allowed_token_ids (allowed [B, V]), bad words (banned [B, R, V], bad_word_hits), then
    min_tokens (mask_ends). z [B, R, V] -> z."""
    z = mask_allowed(z, allowed)
    z = torch.where(banned, torch.full_like(z, float("-inf")), z)
    return mask_ends(z, ends, out_len, min_tokens)


def mask_min_p(z: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """z [B, R, V], min_p [B] in [0, 1] (0: off) -> z with every token whose probability is
    below min_p times the largest at -inf (p(t) / max p = exp(z[t] - max z); log 0 = -inf
    masks nothing)."""
    floor = z.max(-1, keepdim=True).values + torch.log(min_p.to(z.dtype)).view(-1, 1, 1)
    return torch.where(z < floor, torch.full_like(z, float("-inf")), z)


def mask_top_k(z: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """z [B, R, V], top_k [B] int (0, or >= V: off) -> z with every token below the k-th
    largest at -inf (ties with the k-th stay, as runtime/sampling.py's)."""
    vocab = z.shape[-1]
    kk = top_k.to(torch.int64).view(-1, 1, 1)
    ordered = torch.topk(z, vocab, dim=-1).values  # TopK in ONNX (Sort has no export)
    kth = torch.gather(ordered, -1, (kk - 1).clamp(0, vocab - 1).expand(*z.shape[:2], 1))
    on = (kk > 0) & (kk < vocab)
    return torch.where(on & (z < kth), torch.full_like(z, float("-inf")), z)


def mask_top_p(z: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """z [B, R, V], top_p [B] in [1e-20, 1] (1: off) -> z with the tokens outside the top-p set
    at -inf: a token stays if the mass of the tokens more likely than it is < p. Tokens of
    equal probability straddling the boundary are ordered as topk orders them (ONNX TopK: the
    lower index first, as runtime/sampling.py; torch's eager topk leaves it unspecified)."""
    vocab = z.shape[-1]
    p = torch.softmax(z, dim=-1)
    sorted_p, order = torch.topk(p, vocab, dim=-1)
    keep_sorted = (torch.cumsum(sorted_p, -1) - sorted_p) < top_p.view(-1, 1, 1).to(p.dtype)
    keep = torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)
    on = top_p.view(-1, 1, 1) < 1.0
    return torch.where(on & ~keep, torch.full_like(z, float("-inf")), z)


def filter_logits(z: torch.Tensor, top_k: torch.Tensor | None = None,
                  top_p: torch.Tensor | None = None,
                  min_p: torch.Tensor | None = None) -> torch.Tensor:
    """z [B, R, V] (already divided by the temperature) -> z with the filtered-out tokens at
    -inf: min-p, top-k, then top-p. A setting of None skips its step (no row uses it: a sort
    less)."""
    if min_p is not None:
        z = mask_min_p(z, min_p)
    if top_k is not None:
        z = mask_top_k(z, top_k)
    if top_p is not None:
        z = mask_top_p(z, top_p)
    return z


def probs_from_logits(logits: torch.Tensor, temperature: torch.Tensor,
                      top_k: torch.Tensor | None = None,
                      top_p: torch.Tensor | None = None,
                      min_p: torch.Tensor | None = None) -> torch.Tensor:
    """logits [B, R, V] (after process_logits) -> probabilities [B, R, V] after each row's
    temperature [B] (> 0; temperature_or_one for greedy rows), min-p [B], top-k [B] and top-p
    [B] (None: no row filters). Computes in the logits' dtype promoted to at least float32."""
    dtype = torch.promote_types(logits.dtype, torch.float32)
    z = logits.to(dtype) / temperature.to(dtype).view(-1, 1, 1)
    return torch.softmax(filter_logits(z, top_k, top_p, min_p), dim=-1)


def race(r: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """r [..., V] nonnegative weights -> one index per row [...], with probability r / sum(r):
    the exponential race argmax(r / E), E ~ Exp(1) i.i.d., with no cumsum, sort or host sync."""
    e = torch.empty_like(r).exponential_(generator=generator)
    return (r / e).argmax(-1)


def sample(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
           top_p: torch.Tensor, greedy: torch.Tensor, filtered: bool = True,
           generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row, runtime/sampling.py's next_token: logits [B, R, V] -> (tokens
    [B, R], probs [B, R, V]); greedy [B] rows take the argmax (their probs are one-hot), the
    others draw from probs_from_logits. filtered=False: no row uses top-k or top-p (the
    caller knows from the host settings), so neither is applied."""
    t = temperature_or_one(temperature, greedy)
    p = probs_from_logits(logits, t, top_k if filtered else None, top_p if filtered else None)
    argmax = logits.argmax(-1)  # (B, R)
    onehot = torch.nn.functional.one_hot(argmax, logits.shape[-1]).to(p.dtype)
    p = torch.where(greedy[:, None, None], onehot, p)
    return torch.where(greedy[:, None], argmax, race(p, generator)), p
