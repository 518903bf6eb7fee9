"""Prompt logprobs on the device executor (runtime/device/loop.py): the prefill's logits at
every prompt row, reduced on the device to what the host reports, copied back once.

    logits [B, T, V] (row t: after prompt token t)
      -> per stream wanting them, rows 0..len - 2 (each predicts the prompt's next token):
         log-softmax in float64 (runtime/sampling.py log_softmax), the prompt token's logprob
         and rank, the n most likely (id, logprob)
      -> host: [rows, 2 + 2n] float64, one copy per stream
      -> Stream.prompt_logprobs = [None, TokenLogprob ...] (runtime/stream.py
         record_prompt_logprobs' format: the first token has none)

Ties in the top n are ordered as the host orders them: most likely first, then the lower id.
"""

from __future__ import annotations

import numpy as np
import torch

from trt_spec.runtime.sampling import TokenLogprob
from trt_spec.runtime.stream import Stream


def wanted(streams: list[Stream]) -> bool:
    return any(s.params.prompt_logprobs is not None for s in streams)


def logits_index(q: torch.Tensor, t: int, every_row: bool) -> torch.Tensor:
    """[B, N] the rows a prefill of q [B] new tokens (padded to t) reads logits at: its last
    (N = 1), or every row (N = t, rows past a stream's last repeat it); the last column is
    always each stream's last row (its first output token's logits)."""
    last = (q - 1).clamp(min=0)[:, None]
    if not every_row:
        return last
    return torch.minimum(torch.arange(t, device=q.device)[None], last)


def record(chunks: list[tuple[Stream, int]], lo: int, logits: torch.Tensor) -> None:
    """Extends the prompt logprobs of each stream that asks for them from a prefill chunk's
    logits [B, T, V] (slots lo..; every row: `logits_index`): the chunk's n rows at positions
    prefill_pos .. (not yet advanced), each predicting the prompt's next token (the prompt's
    last row predicts the first output token: not a prompt token's, left out)."""
    for s, n in chunks:
        top = s.params.prompt_logprobs
        if top is None:
            continue
        start, prompt = s.prefill_pos, s.prompt_ids
        if start == 0:
            s.prompt_logprobs = [None]
        count = min(n, len(prompt) - 1 - start)
        rows = logits[s.slot - lo, :count]  # (count, V)
        s.prompt_logprobs += token_logprobs(rows, prompt[start + 1:start + 1 + count], top)


def token_logprobs(logits: torch.Tensor, tokens: list[int], n: int) -> list[TokenLogprob]:
    """logits [R, V] on the device, tokens [R] -> runtime/sampling.py token_logprobs' values,
    reduced on the device and copied once."""
    if not len(tokens):
        return []
    logp = torch.log_softmax(logits.to(torch.float64), -1)  # (R, V)
    ids = torch.as_tensor(tokens, dtype=torch.long, device=logits.device)
    own = logp.gather(1, ids[:, None])  # (R, 1)
    rank = 1 + (logp > own).sum(-1, keepdim=True)  # (R, 1)
    values, top = logp.topk(min(n, logp.shape[-1]), -1)  # (R, n) most likely first
    host = torch.cat([own, rank.to(torch.float64), values, top.to(torch.float64)], 1).cpu()
    host = host.numpy()
    m = values.shape[-1]
    out = []
    for t, row in zip(tokens, host):
        vals, idx = row[2:2 + m], row[2 + m:].astype(np.int64)
        order = np.lexsort((idx, -vals))  # ties: the lower id first
        out.append(TokenLogprob(int(t), float(row[0]),
                                tuple((int(idx[j]), float(vals[j])) for j in order),
                                int(row[1])))
    return out
