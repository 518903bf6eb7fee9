"""The sampling controls on the device (vLLM's masks: allowed_token_ids, bad words,
min_tokens; logit_bias, the repetition / frequency / presence penalties, min_p), per cache
slot, for the device executor (runtime/device/loop.py): the host's order and arithmetic
(runtime/sampling.py process_logits, then min-p after the temperature), written with
runtime/sampling_torch.py's transforms.

    target rows [last, d1..dk]  -> mask(allowed, bad words over the row's output tail from
                                   the loop's seq and d1..dj, the end tokens while
                                   n - start + j < min_tokens)
                                -> process_logits(bias, row_counts(output counts, drafts),
                                   prompt_seen, repetition, frequency, presence)
                                -> min-p's dropped tokens at -inf (on z / T, as the host)
    after the commit              output counts += the emitted tokens

The tensors are made on the first request that uses a control and keep their addresses
(CUDA graphs read them); a slot's row is set at its stream's admission, neutral for a
stream without controls. The masks' tensors are made on the first request with a mask, the
bad words' table [slots, W, H] grown (to powers of two) for a request with more or longer
words: admit says so, and the loop's captured graphs, which read the old ones, go. The
drafters draft without the controls: verification stays
exact for any drafter's q (acceptance only changes).
"""

from __future__ import annotations

import torch

from trt_spec.runtime import sampling_torch
from trt_spec.runtime.sampling_torch import ANY, NONE
from trt_spec.runtime.stream import Stream


class DeviceControls:
    def __init__(self, slots: int, vocab: int, device, state=None):
        """state: the loop's DeviceState (seq, n, start: each row's output, for the masks)."""
        def full(value, *shape, dtype=torch.float32):
            return torch.full(shape, value, dtype=dtype, device=device)

        self.bias = full(0.0, slots, vocab)  # [slots, V] logit_bias (0: none)
        self.counts = full(0.0, slots, vocab)  # [slots, V] each token's count in the output
        self.prompt_seen = full(False, slots, vocab, dtype=torch.bool)  # [slots, V]
        self.repetition = full(1.0, slots)  # [slots] (1: off)
        self.frequency = full(0.0, slots)  # [slots] (0: off)
        self.presence = full(0.0, slots)  # [slots] (0: off)
        self.min_p = full(0.0, slots)  # [slots] (0: off)
        self.slots, self.vocab, self.device, self.state = slots, vocab, device, state
        self.allowed = None  # [slots, V] bool: allowed_token_ids (all True: none); masks' ...
        self.ends = None  # [slots, V] bool: the end tokens min_tokens holds back
        self.min_tokens = None  # [slots] (0: off)
        self.heads = None  # [slots, W, H] the bad words but their last tokens (ANY-padded)
        self.last = None  # [slots, W] the bad words' last tokens (NONE: no word)

    def admit(self, s: Stream) -> bool:
        """s's row: its controls, its prompt's tokens seen, no output yet. -> whether the
        masks' tensors were made or grown (graphs that read the old ones must go)."""
        p, i = s.params, s.slot
        grew = self.admit_masks(s)
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
        return grew

    def admit_masks(self, s: Stream) -> bool:
        """s's row of the masks' tensors (neutral without masks); made or grown first where
        s needs them -> whether they were."""
        p, i = s.params, s.slot
        words = p.bad_words_ids
        width = max(len(words), 1)
        head = max((len(w) - 1 for w in words), default=0)
        grew = self.allowed is None and p.masks
        if grew:
            self.allowed = torch.ones(self.slots, self.vocab, dtype=torch.bool,
                                      device=self.device)
            self.ends = torch.zeros_like(self.allowed)
            self.min_tokens = torch.zeros(self.slots, dtype=torch.long, device=self.device)
        if self.allowed is None:
            return False
        if grew or width > self.last.shape[1] or max(head, 1) > self.heads.shape[2]:
            self.grow(width, head)
            grew = True
        self.allowed[i] = not p.allowed_token_ids
        self.allowed[i, self.ids(p.allowed_token_ids)] = True
        self.ends[i] = False
        if p.min_tokens:
            self.ends[i, self.ids({*p.eos_token_ids, *p.stop_token_ids})] = True
        self.min_tokens[i] = p.min_tokens
        self.heads[i], self.last[i] = ANY, NONE
        for w, word in enumerate(words):
            *before, self.last[i, w] = word
            if before:
                self.heads[i, w, -len(before):] = torch.tensor(before, device=self.device)
        return grew

    def ids(self, tokens) -> torch.Tensor:
        """The token ids within the vocabulary (one past it masks nothing, as the host's)."""
        return torch.tensor([t for t in tokens if t < self.vocab], dtype=torch.long,
                            device=self.device)

    def grow(self, width: int, head: int) -> None:
        """The bad words' table at least [slots, width, head] (powers of two, at least 1),
        the rows it held kept."""
        old_w, old_h = (0, 0) if self.last is None else (self.last.shape[1], self.heads.shape[2])
        w = max(old_w, 1 << (width - 1).bit_length())
        h = max(old_h, 1 << (max(head, 1) - 1).bit_length())
        heads = torch.full((self.slots, w, h), ANY, dtype=torch.long, device=self.device)
        last = torch.full((self.slots, w), NONE, dtype=torch.long, device=self.device)
        if self.last is not None:
            heads[:, :old_w, h - old_h:] = self.heads
            last[:, :old_w] = self.last
        self.heads, self.last = heads, last

    def masked(self, z: torch.Tensor, lo: int, hi: int, drafts: torch.Tensor | None
               ) -> torch.Tensor:
        """z [B, R, V] of slots [lo, hi) under the masks (drafts [B, R - 1], or None for a
        first token: no output yet). A row's output: seq[start:n] (the loop's state)."""
        b, h = hi - lo, self.heads.shape[2]
        if drafts is None:
            out_len = torch.zeros(b, dtype=torch.long, device=z.device)
            context = torch.full((b, h), NONE, dtype=torch.long, device=z.device)
        else:
            st = self.state
            n, start = st.n[lo:hi], st.start[lo:hi]
            out_len = n - start
            at = n[:, None] - h + torch.arange(h, device=z.device)[None]  # [B, H]
            tail = st.seq[lo:hi].gather(1, at.clamp(min=0))
            context = torch.cat([torch.where(at >= start[:, None], tail, NONE), drafts], 1)
        banned = sampling_torch.bad_word_hits(context, self.heads[lo:hi], self.last[lo:hi],
                                              z.shape[-1])
        return sampling_torch.mask(z, self.allowed[lo:hi], banned, self.ends[lo:hi], out_len,
                                   self.min_tokens[lo:hi])

    def apply(self, logits: torch.Tensor, lo: int, hi: int, drafts: torch.Tensor | None,
              temperature: torch.Tensor) -> torch.Tensor:
        """logits [B, R, V] of slots [lo, hi) over [last, d1..d(R-1)] (drafts [B, R - 1], or
        None when R = 1), temperature [B] (1 on greedy rows) -> z [B, R, V] under the
        controls (float32 at least); min-p's dropped tokens at -inf."""
        if self.allowed is not None:  # some request has (or had) a mask
            logits = self.masked(logits, lo, hi, drafts)
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
