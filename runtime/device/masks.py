"""Structured outputs (json_schema, regex, grammar, choice: runtime/grammar.py) on the device
executor (runtime/device/loop.py): the host's grammar makes each verified row's bitmask, the
device sets what it refuses to -inf before the race, so verification and sampling see the
logits the host executor's see (runtime/guided_step.py apply_masks).

    propose   drafts [B, k] on the device; a model drafter's first draft held to what the
              grammar allows after the output (`steer_first`: the host's drafters hold every
              draft, each to the state after the ones before it, which the device cannot
              know without a round trip per draft)
              host <- drafts, valid (small; on CUDA an async copy, waited on after the
                      score phase is launched, so the masks are made while the target runs)
              per guided stream, along its drafted path (runtime/guided_step.py row_masks):
                  rows 0..a, a = the drafts its grammar allows (row j: the state after the
                  output and drafts 0..j-1; rows past a verify nothing that is accepted)
              bits [B, W, ceil(V / 32)] int32 -> the device (all ones: unguided rows)
    sample    logits of the verified rows where the bit is 0 -> -inf, then the controls and
              the race (runtime/device/verify.py)
    commit    the emitted tokens advance the grammar on the host (runtime/stream.py append)

Whatever was drafted, the device's race gives each output position the token of the target's
masked row there (greedy: its argmax; sampled: its seed's race), so the output equals the host
executor's, which drafts differently under a grammar (forced runs, drafts held to it, model
drafters steered by its masks at every draft): only how many drafts are accepted differs.
The prefill's first token is masked by the grammar's state before any output (`admit`).

A stream whose grammar raises here (a limit of the grammar engine, a bug) keeps the error on
Stream.fault (runtime/guided_step.py guarded) and fails alone after the step.
"""

from __future__ import annotations

import time

import numpy as np
import torch

from trt_spec.runtime.guided_step import guarded, row_masks
from trt_spec.runtime.stream import Stream

ALL = -1  # an int32 of 32 one bits: every token of the word allowed


def guide_masks(loop, streams: list[Stream], steer: bool = True) -> "DeviceMasks | None":
    """loop's masks (made on the first guided request) with this step's guided streams (steer:
    their first drafts' masks uploaded), or None when none of `streams` is guided."""
    guided = {s.slot: s for s in streams if s.guide is not None}
    if not guided:
        return None
    if loop.masks is None:
        loop.masks = DeviceMasks(loop.slots, loop.width, loop.vocab_size, loop.device)
    loop.masks.guided = guided
    if steer:
        loop.masks.steer_first(max(s.slot for s in streams) + 1)
    return loop.masks


class DeviceMasks:
    """The bitmasks of one DeviceLoop's verified rows, per cache slot, at a fixed address (the
    sample phase's CUDA graph reads them)."""

    def __init__(self, slots: int, width: int, vocab: int, device):
        self.words = (vocab + 31) // 32
        self.bits = torch.full((slots, width, self.words), ALL, dtype=torch.int32,
                               device=device)  # [slots, W, words]
        # the first draft's: the grammar's state after the output (`steer_first`)
        self.first = torch.full((slots, self.words), ALL, dtype=torch.int32, device=device)
        ids = torch.arange(vocab, device=device)
        self.word = ids // 32  # [V] each token's word
        self.shift = (ids % 32).to(torch.int32)  # [V] its bit there
        self.device = torch.device(device)
        self.guided: dict[int, Stream] = {}  # slot -> its guided stream, this step
        self.pending = None  # (drafts, valid, event) on their way to the host
        self.seconds = 0.0  # the host's time making and uploading masks, since `spent`

    def unpack(self, bits: torch.Tensor) -> torch.Tensor:
        """bits [..., words] int32 -> bool [..., V]: the tokens they allow."""
        return ((bits[..., self.word] >> self.shift) & 1).bool()

    def steered(self, logits: torch.Tensor, nb: int, d2t: torch.Tensor | None) -> torch.Tensor:
        """A drafter's logits [nb, V'] for its first draft, held to what each guided stream's
        grammar allows after its output (runtime/proposers/base.py `held`: over a draft
        vocabulary by its target ids; a row that allows none of the head's tokens unchanged)."""
        allowed = self.unpack(self.first[:nb])  # (nb, V)
        if d2t is not None:
            allowed = allowed[:, d2t]  # (nb, V')
        allowed |= ~allowed.any(-1, keepdim=True)
        return logits.masked_fill(~allowed, float("-inf"))

    def apply(self, logits: torch.Tensor, lo: int) -> torch.Tensor:
        """logits [B, R, V] of slots [lo, lo + B) -> the same, -inf where the bits refuse."""
        b, r, _ = logits.shape
        return logits.masked_fill(~self.unpack(self.bits[lo:lo + b, :r]), float("-inf"))

    # --- the host's side -----------------------------------------------------------------------

    def admit(self, streams: list[Stream], lo: int, hi: int) -> "DeviceMasks":
        """Row 0 of slots [lo, hi): each new guided stream's grammar before any output (its
        first token's mask), all ones elsewhere."""
        guided = [s for s in streams if s.guide is not None]
        host = np.full((hi - lo, 1, self.words), ALL, dtype=np.int32)
        for s in guided:
            bits = guarded(s, row_masks, s, [])
            if bits is not None:
                host[s.slot - lo, 0] = bits[0]
        self.bits[lo:hi, :1].copy_(torch.from_numpy(host))
        return self

    def steer_first(self, nb: int) -> None:
        """Before the propose phase: each steering guided stream's mask after its output
        (Guide.steer: model drafters draft under it, as on the host), all ones elsewhere. The
        later drafts' masks depend on the drafts before them: only the first one is held
        (the others are cut by verification where the grammar refuses them)."""
        t0 = time.perf_counter()
        host = np.full((nb, self.words), ALL, dtype=np.int32)
        for slot, s in self.guided.items():
            bits = guarded(s, row_masks, s, []) if s.guide.steer else None
            if bits is not None:
                host[slot] = bits[0]
        self.first[:nb].copy_(torch.from_numpy(host), non_blocking=True)
        self.seconds += time.perf_counter() - t0

    def fetch(self, out: dict) -> None:
        """After the propose phase: the drafts and their valid marks on their way to the
        host (on CUDA without waiting: the score phase is launched meanwhile)."""
        blocking = self.device.type != "cuda"
        drafts = out["drafts"].to("cpu", non_blocking=not blocking)
        valid = out["valid"].to("cpu", non_blocking=not blocking)
        event = None
        if not blocking:
            event = torch.cuda.Event()
            event.record()
        self.pending = (drafts, valid, event)

    def upload(self, nb: int) -> None:
        """Before the sample phase: the bits of slots [0, nb) along each guided stream's
        drafts, made on the host, copied to the device (ordered after the score phase)."""
        drafts, valid, event = self.pending
        self.pending = None
        if event is not None:
            event.synchronize()
        t0 = time.perf_counter()
        drafts, valid = drafts.numpy(), valid.numpy()
        rows = self.bits.shape[1]
        host = np.full((nb, rows, self.words), ALL, dtype=np.int32)
        for slot, s in self.guided.items():
            path = drafts[slot, :int(valid[slot].sum())]  # (valid: a prefix of the row)
            bits = guarded(s, row_masks, s, path)
            if bits is not None:  # (a faulted stream fails after the step)
                host[slot, :len(bits)] = bits[:rows]
        self.bits[:nb].copy_(torch.from_numpy(host), non_blocking=True)
        self.seconds += time.perf_counter() - t0

    def spent(self) -> float:
        """Seconds the host spent on masks since the last call (StepMetrics.mask_s)."""
        seconds, self.seconds = self.seconds, 0.0
        return seconds
