"""The drafters of the device loop (runtime/device/loop.py): each proposes k tokens per stream
with fixed shapes and no host round trip, from state kept on the device.

    NgramDrafts    prompt lookup over the token history `seq`: the latest earlier match of
                   the last n tokens (n from max_n down to min_n), runtime/proposers/ngram.py's
                   rule; fewer than k tokens marks the rest invalid
    VanillaDrafts  the draft model over its own cache: catch up (1 or 2 tokens: the last
                   accepted draft it had not fed, and the new target token), then k - 1 steps
    HeadDrafts     MTP (N modules, the last one loops), Eagle (N = 1) and Eagle3 (N = 1, fc on
                   the target's features, a draft vocabulary): every module catches up on rows
                   [start, anchor] from the target's rows kept in `hist`, then the last module
                   loops one row at a time (runtime/proposers/mtp.py's bookkeeping, with
                   `start` kept per slot on the device)
    UploadedDrafts a host drafter's (runtime/device/host_drafts.py): the uploaded drafts, or
                   its model head's (one of the above) where the head is the row's source

Each is a method's device face (runtime/methods.py Method.device). Row p of a drafter cache
sits at position p, as on the host. `propose` writes the drafts into `seq` at positions
n .. n + k - 1 (scratch until verified), so a later module reads them as its input tokens.
`commit(n_old, accepted)` moves the per-slot bookkeeping after verification.

A model drafter draws its draft j of a sampled stream as the race of the stream's seed at
that output position over its own q (`pick`): the target's noise there, so the draft equals
the target's token as often as the coupling allows (runtime/verify.py), as the host's
proposers draw (runtime/proposers/base.py pick_draft). Verification reads no q.
"""

from __future__ import annotations

import torch


class DeviceDrafter:
    """What the loop asks of a drafter; `loop` is the DeviceLoop (state and helpers)."""

    def read(self, loop, lo: int, hi: int, new: torch.Tensor, past: torch.Tensor,
             q: torch.Tensor, rows: dict[str, torch.Tensor]) -> None:
        """After a prefill forward (a chunk of each prompt) of slots [lo, hi): new [B] the
        slots it read, their q [B] rows at positions past [B] ..; rows: the target's
        per-token outputs [B, T, D] (runtime/device/prefill.py)."""

    def prefill(self, loop, lo: int, hi: int, new: torch.Tensor, prompt_len: torch.Tensor
                ) -> None:
        """After the target's prefill of slots [lo, hi) (its last chunk): new [B] the slots
        whose prompts are now read, prompt_len [B]."""

    def propose(self, loop, nb: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Slots [0, nb) -> (drafts [nb, k] int64, valid [nb, k] bool)."""
        raise NotImplementedError

    def commit(self, loop, nb: int, n_old: torch.Tensor, accepted: torch.Tensor,
               rows: dict[str, torch.Tensor]) -> None:
        """After verification: n_old [nb] tokens known before the step, accepted [nb], rows:
        the target's per-token outputs of the verify forward [nb, W, D]."""


def pick(loop, logits: torch.Tensor, nb: int, d2t: torch.Tensor | None, j: int) -> torch.Tensor:
    """Draft j (0-based) per row from a drafter's logits [nb, head_vocab] -> target ids [nb].
    runtime/proposers/base.py pick_draft's rule: greedy rows take the argmax, others the race
    over q (the request's temperature / top-k / top-p applied to the head) with the target's
    noise at the draft's output position, id for id through a draft vocabulary's d2t."""
    s = loop.state
    if j == 0 and loop.guided:  # the grammar's state after the output (masks.py)
        logits = loop.masks.steered(logits, nb, d2t)
    position = (s.n[:nb] - s.start[:nb] + j)[:, None]  # (nb, 1)
    d = loop.tokens(logits[:, None], slice(0, nb), position, d2t)[:, 0]
    return d if d2t is None else d2t[d]


def model_drafter(loop, gen, method: str) -> tuple:
    """A model drafter's (manifest entry, step graphs, d2t [V'] on the device or None: the
    target's vocabulary)."""
    entry = gen.drafters[method]
    vocab = gen.vocab(entry)
    d2t = None if vocab is None else torch.from_numpy(vocab.draft_to_target).to(loop.device)
    return entry, [gen.step_graph(g, entry.config) for g in entry.graphs], d2t


class NgramDrafts(DeviceDrafter):
    def __init__(self, loop, c):  # c: the SpeculationConfig (ngram_min, ngram_max)
        self.k, self.min_n, self.max_n = loop.k, c.ngram_min, c.ngram_max

    def propose(self, loop, nb):
        s = loop.state
        seq, n = s.seq[:nb], s.n[:nb]  # (nb, L), (nb,)
        length = seq.shape[1]
        start = torch.full_like(n, -1)  # (nb,) where the continuation starts; -1: no match
        for m in range(self.max_n, self.min_n - 1, -1):
            last = seq.gather(1, (n[:, None] - m + torch.arange(m, device=n.device)).clamp(min=0))
            windows = seq.unfold(1, m, 1)  # (nb, L - m + 1, m): every n-gram
            hit = (windows == last[:, None, :]).all(-1)  # (nb, L - m + 1)
            j = torch.arange(hit.shape[1], device=n.device)
            # an earlier n-gram: it ends before the last token (tokens[:-1]); m <= n - 1
            hit &= (j[None] + m <= n[:, None] - 1) & (n[:, None] - 1 >= m)
            best = torch.where(hit, j[None], -1).max(-1).values  # (nb,) the most recent
            start = torch.where((start < 0) & (best >= 0), best + m, start)
        cols = torch.arange(self.k, device=n.device)
        at = start[:, None] + cols  # (nb, k)
        valid = (start[:, None] >= 0) & (at < n[:, None]) & s.active[:nb, None]
        drafts = seq.gather(1, at.clamp(0, length - 1))
        return torch.where(valid, drafts, 0), valid


class VanillaDrafts(DeviceDrafter):
    CATCH_UP = 2  # tokens the draft has not fed at a step: <= 2 (module docstring)

    def __init__(self, loop, gen, method: str):
        entry, graphs, self.d2t = model_drafter(loop, gen, method)
        self.graph, self.k = graphs[0], loop.k
        self.cache = loop.new_cache(entry.config)
        self.fed = torch.zeros(loop.slots, dtype=torch.long, device=loop.device)  # rows held

    def prefill(self, loop, lo, hi, new, prompt_len):
        # the prompt but its last token (the first step feeds it with the first new token)
        q = torch.where(new, (prompt_len - 1).clamp(min=0), 0)
        t = int(q.max())
        if t:
            ids = loop.state.seq[lo:hi, :t]
            past = torch.zeros_like(q)
            loop.forward(self.graph, self.cache, lo, hi, ids, past, q, (q - 1).clamp(min=0)[:, None])
        self.fed[lo:hi] = torch.where(new, q, self.fed[lo:hi])

    def propose(self, loop, nb):
        s = loop.state
        n, fed, active = s.n[:nb], self.fed[:nb], s.active[:nb]
        cols = torch.arange(self.CATCH_UP, device=n.device)
        q = torch.where(active, (n - fed).clamp(1, self.CATCH_UP), 0)
        ids = s.seq[:nb].gather(1, (fed[:, None] + cols).clamp(max=s.seq.shape[1] - 1))
        logits, = loop.forward(self.graph, self.cache, 0, nb, ids, fed, q,
                               (q - 1).clamp(min=0)[:, None])[:1]
        drafts = []
        for j in range(self.k):
            if j:
                pos = n - 1 + j  # d_j sits at position n - 1 + j
                logits, = loop.forward(self.graph, self.cache, 0, nb, drafts[-1][:, None], pos,
                                       active.long(), torch.zeros_like(pos)[:, None])[:1]
            d = pick(loop, logits[:, 0], nb, self.d2t, j)
            loop.write_tokens(nb, n + j, d)
            drafts.append(d)
        return torch.stack(drafts, 1), active[:, None].expand(nb, self.k)

    def commit(self, loop, nb, n_old, accepted, rows):
        # the draft fed up to d_{k-1}; the accepted ones are kept
        kept = n_old + torch.minimum(accepted, torch.full_like(accepted, self.k - 1))
        self.fed[:nb] = torch.where(loop.state.active[:nb], kept, self.fed[:nb])


class HeadDrafts(DeviceDrafter):
    """MTP / Eagle / Eagle3. reads (the method's): the target output the first module's hidden
    input comes from ("hidden_states"; Eagle3 "eagle3_features" through fc)."""

    def __init__(self, loop, gen, method: str, reads: str):
        entry, graphs, self.d2t = model_drafter(loop, gen, method)
        self.num_modules = min(len(graphs), loop.k)  # modules past k never run
        self.graphs = graphs[:self.num_modules]
        self.reads, self.k = reads, loop.k
        self.fc = gen.graphs.device_function(entry.fc_graph) if entry.fc_graph else None
        self.width = loop.k + self.num_modules  # catch-up rows per step: accepted + N
        self.caches = [loop.new_cache(entry.config) for _ in self.graphs]
        # the first module's hidden input per position (fc applied: Eagle3)
        self.hist = torch.zeros(loop.slots, loop.length, entry.config.hidden_size,
                                dtype=loop.dtype, device=loop.device)
        self.start = torch.zeros(loop.slots, dtype=torch.long, device=loop.device)

    def _first_hidden(self, rows: torch.Tensor) -> torch.Tensor:
        x = rows[self.reads]
        return (self.fc(x) if self.fc is not None else x).to(self.hist.dtype)

    def _catch_up(self, loop, lo, hi, start, q, width):
        """Every module over rows [start, start + q) of slots [lo, hi) (width columns);
        -> (last module's logits at row q - 1 [B, 1, V'], its hidden there [B, 1, H],
        drafts of each module [B] when drafting else None)."""
        rows = start[:, None] + torch.arange(width, device=start.device)  # (B, W) positions
        at = rows.clamp(max=loop.length - 1)
        hidden = self.hist[lo:hi].gather(1, at[..., None].expand(-1, -1, self.hist.shape[-1]))
        seq = loop.state.seq[lo:hi]
        out = None
        for i, (graph, cache) in enumerate(zip(self.graphs, self.caches)):
            ids = seq.gather(1, (rows + i + 1).clamp(max=seq.shape[1] - 1))
            out = loop.forward(graph, cache, lo, hi, ids, start, q, (q - 1).clamp(min=0)[:, None],
                               hidden)
            hidden = out[1]  # module i's rows: module i + 1's hidden input
            yield i, out

    def read(self, loop, lo, hi, new, past, q, rows):
        h = self._first_hidden(rows)  # (B, T, H) positions past ..
        cols = torch.arange(h.shape[1], device=h.device)
        pos = torch.where(new[:, None] & (cols[None] < q[:, None]), past[:, None] + cols,
                          loop.length - 1).clamp(max=loop.length - 1)
        self.hist[lo:hi].scatter_(1, pos[..., None].expand_as(h), h)

    def prefill(self, loop, lo, hi, new, prompt_len):
        # rows every module may commit now: p + N <= P - 1 + 1 (module docstring)
        s0 = torch.where(new, (prompt_len - self.num_modules).clamp(min=0), 0)
        width = int(s0.max())
        if width:
            zero = torch.zeros_like(s0)
            for _ in self._catch_up(loop, lo, hi, zero, s0, width):
                pass
        self.start[lo:hi] = torch.where(new, s0, self.start[lo:hi])

    def propose(self, loop, nb):
        s = loop.state
        n, start, active = s.n[:nb], self.start[:nb], s.active[:nb]
        anchor = n - 2
        q = torch.where(active, (anchor - start + 1).clamp(0, self.width), 0)
        drafts = []
        last = None
        for i, out in self._catch_up(loop, 0, nb, start, q, self.width):
            d = pick(loop, out[0][:, 0], nb, self.d2t, i)
            loop.write_tokens(nb, n + i, d)
            drafts.append(d)
            last = out
        row = (q - 1).clamp(min=0)[:, None, None].expand(-1, 1, last[1].shape[-1])
        hidden = last[1].gather(1, row)  # (nb, 1, H) the last module's hidden at the anchor
        for j in range(self.num_modules, self.k):  # the last module loops, one row each
            pos = n - 1 + j - self.num_modules
            out = loop.forward(self.graphs[-1], self.caches[-1], 0, nb, drafts[-1][:, None],
                               pos, active.long(), torch.zeros_like(pos)[:, None], hidden)
            d = pick(loop, out[0][:, 0], nb, self.d2t, j)
            loop.write_tokens(nb, n + j, d)
            drafts.append(d)
            hidden = out[1]
        return torch.stack(drafts, 1), active[:, None].expand(nb, self.k)

    def commit(self, loop, nb, n_old, accepted, rows):
        active = loop.state.active[:nb]
        h = self._first_hidden(rows)  # (nb, W, H) positions n_old - 1 ..
        pos = (n_old - 1)[:, None] + torch.arange(h.shape[1], device=h.device)
        pos = torch.where(active[:, None], pos, loop.length - 1).clamp(max=loop.length - 1)
        self.hist[:nb].scatter_(1, pos[..., None].expand_as(h), h)
        # committed rows of module i: n_old - 1 - i; the next step catches up from the least
        nxt = (n_old - self.num_modules).clamp(min=0)
        self.start[:nb] = torch.where(active, nxt, self.start[:nb])


class UploadedDrafts(DeviceDrafter):
    """A host drafter's device face: each row's drafts and length, uploaded into `table` (by
    runtime/device/host_drafts.py), or where the row's source is the proposer's model head
    that head's drafts here (head: its device face, or None)."""

    def __init__(self, loop, head: DeviceDrafter | None):
        self.head, self.k = head, loop.k
        # [slots, k + 2]: the drafts | their length | 1 where the device head drafts the row
        self.table = torch.zeros(loop.slots, loop.k + 2, dtype=torch.long, device=loop.device)

    @property
    def hist(self):
        """The head's hidden rows (a prefix-cache hit copies them: prefill.py copy_slot)."""
        return getattr(self.head, "hist", None)

    def read(self, loop, lo, hi, new, past, q, rows):
        if self.head is not None:
            self.head.read(loop, lo, hi, new, past, q, rows)

    def prefill(self, loop, lo, hi, new, prompt_len):
        if self.head is not None:
            self.head.prefill(loop, lo, hi, new, prompt_len)

    def propose(self, loop, nb):
        k = self.k
        tokens, length = self.table[:nb, :k], self.table[:nb, k]
        if self.head is not None:
            head, _ = self.head.propose(loop, nb)
            tokens = torch.where(self.table[:nb, k + 1, None].bool(), head, tokens)
        cols = torch.arange(k, device=tokens.device)
        valid = (cols[None] < length[:, None]) & loop.state.active[:nb, None]
        return torch.where(valid, tokens, 0), valid

    def commit(self, loop, nb, n_old, accepted, rows):
        if self.head is not None:
            self.head.commit(loop, nb, n_old, accepted, rows)
