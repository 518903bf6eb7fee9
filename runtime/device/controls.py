"""The sampling controls on the device (logit_bias, the repetition / frequency / presence
penalties, min_p), per cache slot, for the device executor (runtime/device/loop.py): the
host's order and arithmetic (runtime/sampling.py process_logits, then min-p after the
temperature), written with runtime/sampling_torch.py's transforms.

    target rows [last, d1..dk]  -> process_logits(bias, row_counts(output counts, drafts),
                                   prompt_seen, repetition, frequency, presence)
                                -> min-p's dropped tokens at -inf (on z / T, as the host)
    after the commit              output counts += the emitted tokens

The tensors are made on the first request that uses a control and keep their addresses
(CUDA graphs read them); a slot's row is set at its stream's admission, neutral for a
stream without controls. The drafters draft without the controls: verification stays
exact for any drafter's q (acceptance only changes).
"""

from __future__ import annotations

import torch

from trt_spec.runtime import sampling_torch
from trt_spec.runtime.stream import Stream


class DeviceControls:
    def __init__(self, slots: int, vocab: int, device):
        def full(value, *shape, dtype=torch.float32):
            return torch.full(shape, value, dtype=dtype, device=device)

        self.bias = full(0.0, slots, vocab)  # [slots, V] logit_bias (0: none)
        self.counts = full(0.0, slots, vocab)  # [slots, V] each token's count in the output
        self.prompt_seen = full(False, slots, vocab, dtype=torch.bool)  # [slots, V]
        self.repetition = full(1.0, slots)  # [slots] (1: off)
        self.frequency = full(0.0, slots)  # [slots] (0: off)
        self.presence = full(0.0, slots)  # [slots] (0: off)
        self.min_p = full(0.0, slots)  # [slots] (0: off)

    def admit(self, s: Stream) -> None:
        """s's row: its controls, its prompt's tokens seen, no output yet."""
        p, i = s.params, s.slot
        self.bias[i] = 0.0
        if p.logit_bias:
            ids, bias = zip(*p.logit_bias)
            self.bias[i, list(ids)] = torch.tensor(bias, dtype=torch.float32,
                                                   device=self.bias.device)
        self.counts[i] = 0.0
        self.prompt_seen[i] = False
        self.prompt_seen[i, list(set(s.prompt_ids))] = True
        self.repetition[i] = p.repetition_penalty
        self.frequency[i] = p.frequency_penalty
        self.presence[i] = p.presence_penalty
        self.min_p[i] = p.min_p

    def apply(self, logits: torch.Tensor, lo: int, hi: int, drafts: torch.Tensor | None,
              temperature: torch.Tensor) -> torch.Tensor:
        """logits [B, R, V] of slots [lo, hi) over [last, d1..d(R-1)] (drafts [B, R - 1], or
        None when R = 1), temperature [B] (1 on greedy rows) -> z [B, R, V] under the
        controls (float32 at least); min-p's dropped tokens at -inf."""
        counts = self.counts[lo:hi]
        rows = counts[:, None] if drafts is None else sampling_torch.row_counts(counts, drafts)
        z = sampling_torch.process_logits(
            logits, self.bias[lo:hi], rows, self.prompt_seen[lo:hi], self.repetition[lo:hi],
            self.frequency[lo:hi], self.presence[lo:hi])
        t = temperature.to(z.dtype).view(-1, 1, 1)
        kept = sampling_torch.mask_min_p(z / t, self.min_p[lo:hi])
        return torch.where(torch.isinf(kept) & ~torch.isinf(z), float("-inf"), z)

    def count(self, lo: int, hi: int, tokens: torch.Tensor, keep: torch.Tensor) -> None:
        """The emitted tokens [B, T] of slots [lo, hi) where keep [B, T] added to the counts
        (a row past what it emitted holds PLACEHOLDER, -1: counted nowhere, read as id 0)."""
        self.counts[lo:hi].scatter_add_(1, tokens.clamp(min=0), keep.to(self.counts.dtype))
