"""MTP proposer: N modules over their own one-layer caches, drafting from the target's hidden
state (export/drafters.py has the module). Eagle and Eagle3 are this proposer with one module.

Row p of a module's cache sits at position p. With n tokens known (x_0 .. x_{n-1}) the target
has given hidden states for positions 0 .. n-2 (the last token is not scored yet), so the
anchor row is a = n-2, and a propose step is

    module 0   rows [start, a]: token x_{p+1}, target hidden h_p       -> logits at a: d1
    module i   rows [start, a]: token x_{p+i+1} (d_i at row a), module i-1's hidden at p -> d_{i+1}
    past N     the last module loops, Eagle-style: row a+1, a+2, ... reads (d_j, its own
               hidden of the row before) -> d_{j+1}

A module's row p is reusable by later steps only when every token it read is a real one:
p + i + 1 <= n - 1. Those rows are the module's `committed` count; rows after it (drafts,
loop rows) are scratch and dropped by the next propose, which also catches every module up
from the smallest committed count it needs, so module i-1's hidden states for module i's rows
are recomputed in the same batched forward instead of stored. The target rows (`observe`)
are kept from that smallest count on.

A head that sat out many steps (the speculation policy turned it off) does not catch up on
every row it skipped: past REPRIME rows its caches start again on the last REPRIME, at
shifted positions (`restart`), so a probe after a long pause costs about one short step.

A slot's state outlives its request (prefix caching): a later request that starts from the
slot's target rows (`adopt`, in place or copied to another slot) keeps each module's rows
that read only tokens the two share, and the target's rows kept for the modules to catch up
on; only the shared rows of the old request's last step (never observed: it ended there)
are read again. Where the slot's head rows cannot be reused (another stream's, or
re-primed), the head starts afresh at the first row the new request reads, re-primed there:
the target's shared rows are reused either way.

Drafts are argmax of the module's logits when greedy; when sampling, they are drawn from q
(the module's distribution after the request's temperature / top-k / top-p) and q is returned,
so verification stays lossless either way. A head over a draft vocabulary (`vocab`: Eagle3's,
or an MTP / Eagle head exported with --draft-vocab) maps its ids to target ids (pick_draft).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from trt_spec.runtime.backends.base import StepGraph
from trt_spec.runtime.kv_cache import KVCache
from trt_spec.runtime.proposers.base import (Drafts, DraftVocab, Proposer, confidence,
                                             pick_draft)
from trt_spec.runtime.step_inputs import SlotTokens


REPRIME = 64  # rows: the most a head catches up on before a draft (MtpProposer.restart)


class Rows:
    """The target's rows for positions base .. end - 1, in one buffer that grows by doubling:
    a step writes only its new rows, and dropping the oldest moves an offset (no copy of
    what is kept, however long a stream decodes without drafting)."""

    def __init__(self, base: int, rows: np.ndarray):
        self.buf = np.empty((max(2 * len(rows), 64), rows.shape[1]), dtype=rows.dtype)
        self.buf[:len(rows)] = rows
        self.lo, self.hi = 0, len(rows)  # buf[lo:hi] holds positions base .. end - 1
        self.base = base

    def __len__(self) -> int:
        return self.hi - self.lo

    @property
    def end(self) -> int:
        return self.base + len(self)

    def rows(self, start: int, stop: int) -> np.ndarray:
        """A view of the rows for positions [start, stop) (valid until the next write)."""
        assert self.base <= start <= stop <= self.end, (self.base, start, stop, self.end)
        return self.buf[self.lo + start - self.base:self.lo + stop - self.base]

    def write(self, start: int, rows: np.ndarray) -> None:
        """Rows for positions start .. (base <= start <= end): what was there from start on
        is replaced."""
        assert self.base <= start <= self.end, (self.base, start, self.end)
        at = self.lo + start - self.base
        if at + len(rows) > len(self.buf):
            kept = self.buf[self.lo:at]
            grown = np.empty((max(2 * (len(kept) + len(rows)), 64), self.buf.shape[1]),
                             dtype=self.buf.dtype)
            grown[:len(kept)] = kept
            self.buf, self.lo, at = grown, 0, len(kept)
        self.buf[at:at + len(rows)] = rows
        self.hi = at + len(rows)

    def drop_before(self, pos: int) -> None:
        """Forgets the rows before position pos (base <= pos <= end)."""
        assert self.base <= pos <= self.end, (self.base, pos, self.end)
        self.lo += pos - self.base
        self.base = pos


@dataclass
class SlotState:
    stream_id: int
    base: int  # the first position the target's rows are kept from
    hist: Rows | None  # the target's rows for positions base ..; None: none yet
    committed: list[int]  # per module: positions before this are valid rows for later steps
    broken: bool = False  # a gap in the target rows: this stream gets no drafts
    offset: int = 0  # the position of every module's cache row 0 (re-primed: see propose)

    @property
    def end(self) -> int:
        return self.base if self.hist is None else self.hist.end


class MtpProposer(Proposer):
    name = "mtp"
    reads = "hidden_states"
    # module i catches up on every row it skipped: `auto` plans k from acceptance by position
    # before drafting (DraftLength.plan) rather than stopping per step; Eagle and Eagle3
    # (one module, always run) stop per step on confidence
    gated = False

    def __init__(self, modules: list[StepGraph], caches: list[KVCache],
                 vocab: DraftVocab | None = None, reprime: int = REPRIME):
        """reprime: a head that would catch up on more rows than this reads only the last
        `reprime` (`restart`)."""
        assert modules and len(modules) == len(caches), (len(modules), len(caches))
        assert reprime >= 1, reprime
        self.reprime = reprime
        self.modules = modules
        self.caches = caches  # one per module, same slot count as the target's
        self.vocab = vocab  # the heads' draft vocabulary; None: the target's
        self.slots: dict[int, SlotState] = {}

    # --- the target's rows ---------------------------------------------------------------

    def observe(self, s, start: int, rows: np.ndarray) -> None:
        st = self.slots.get(s.slot)
        if st is None or st.stream_id != s.id:
            self.slots[s.slot] = SlotState(s.id, start, Rows(start, rows),
                                           [0] * len(self.modules), broken=start != 0)
            return
        if not st.base <= start <= st.end:
            st.broken = True
            return
        if st.hist is None:
            st.hist = Rows(start, rows)
        else:
            st.hist.write(start, rows)

    def release(self, s) -> None:
        """The slot's state stays: a later request may start from its rows (`adopt`)."""

    def adopt(self, s, src: int, n: int, owner: int) -> int:
        st = self.slots.get(src)
        if st is None or st.stream_id != owner or st.broken or st.offset:
            # this head's rows are not those of the target's (another stream wrote them, or
            # they were re-primed): the head starts afresh at position n, as `restart` does,
            # on the rows the new request reads; the target's n rows are reused all the same
            # (reading them again for the head would cost a whole prefill to win a context
            # the head re-primes away after REPRIME rows anyway)
            for cache in self.caches:
                cache.lengths[s.slot] = 0
            self.slots[s.slot] = SlotState(s.id, n, None, [n] * len(self.modules), offset=n)
            return n
        # module j's row p read tokens up to p + j + 1: valid while that is in the prefix
        committed = [max(0, min(c, n - 1 - j)) for j, c in enumerate(st.committed)]
        for cache, c in zip(self.caches, committed):
            if src != s.slot:
                cache.copy_rows(src, s.slot, c)
            cache.lengths[s.slot] = c
        start = min(committed)
        # the target's rows it holds from `start` on (observed up to the old stream's last
        # verification: the rows of its last step, if shared, are read again); where they
        # are gone (or were never observed), they are read again from `start`
        held = st.hist is not None and st.base <= start <= st.end
        end = min(n, st.end) if held else start
        hist = Rows(start, st.hist.rows(start, end)) if held and end > start else None
        self.slots[s.slot] = SlotState(s.id, start, hist, committed)
        return end

    def restart(self, slot: int, st: SlotState, start: int) -> int:
        """Every module's cache starts again at position `start`, cache row 0 (-> start).
        A stream whose head sat out many steps would otherwise catch up on every row it
        skipped, the first draft of a request on its whole prompt: one layer over hundreds of
        rows per stream, more than the draft can win back. Re-primed, the head reads the last
        `reprime` rows only, at shifted positions: rotary attention depends on the distance
        between rows, so each row sees what it would see at its true position with only that
        window before it (a shorter context, not a wrong one; verification stays exact)."""
        st.offset = start
        st.committed = [start] * len(self.modules)
        for cache in self.caches:
            cache.lengths[slot] = 0
        return start

    # --- what Eagle3 changes -------------------------------------------------------------

    def first_hidden(self, rows: list[np.ndarray]) -> list[np.ndarray]:
        """The target's rows [r_i, D] -> the first module's hidden_states input [r_i, H]."""
        return rows

    def pick(self, s, logits: np.ndarray, drafted=()) -> tuple[int, np.ndarray | None]:
        """logits [head_vocab] -> (target token, q [vocab] or None when greedy); drafted: the
        stream's drafts before it this step."""
        return pick_draft(s, logits, self.vocab, drafted)

    # --- propose -------------------------------------------------------------------------

    def propose(self, streams, ks, gate=None):
        n_modules = len(self.modules)
        tokens = [[] for _ in streams]
        probs = [[] for _ in streams]
        seqs, starts, anchors, rows = {}, {}, {}, {}
        for i, (s, k) in enumerate(zip(streams, ks)):
            st = self.slots.get(s.slot)
            seq = s.prompt_ids + s.output_ids
            anchor = len(seq) - 2
            if k <= 0 or st is None or st.stream_id != s.id or st.broken or st.end != anchor + 1:
                continue
            start = min(st.committed[:min(k, n_modules)])
            assert st.base <= start <= anchor, (st.base, start, anchor)
            if anchor + 1 - start > self.reprime:
                start = self.restart(s.slot, st, anchor + 1 - self.reprime)
            for cache in self.caches[:min(k, n_modules)]:
                cache.rewind(s.slot, start - st.offset)
            seqs[i], starts[i], anchors[i] = seq, start, anchor
            rows[i] = st.hist.rows(start, anchor + 1)
        ok = list(seqs)
        hidden = dict(zip(ok, self.first_hidden([rows[i] for i in ok])))
        stopped = set()  # streams the gate stopped
        for j in range(max((ks[i] for i in ok), default=0)):
            active = [i for i in ok if ks[i] > j and i not in stopped]
            if not active:
                break
            if j < n_modules:  # module j over rows [start, anchor]
                requests = []
                for i in active:
                    ids = seqs[i][starts[i] + j + 1:anchors[i] + j + 2]
                    requests.append(SlotTokens(streams[i].slot, ids, [len(ids) - 1], hidden[i]))
                module, cache = self.modules[j], self.caches[j]
            else:  # the last module, one more row
                requests = [SlotTokens(streams[i].slot, [seqs[i][-1]], [0], hidden[i][-1:])
                            for i in active]
                module, cache = self.modules[-1], self.caches[-1]
            out = module.step(cache, requests, ("next_hidden_states",))
            for i, logits, h in zip(active, out.logits, out.rows["next_hidden_states"]):
                token, q = self.pick(streams[i], logits[-1], tokens[i])
                seqs[i].append(token)
                tokens[i].append(token)
                probs[i].append(q)
                hidden[i] = h
                if gate is not None and not gate.more(i, confidence(logits[-1], q, token)):
                    stopped.add(i)
        for i in ok:
            st = self.slots[streams[i].slot]
            n = anchors[i] + 2
            ran = min(len(tokens[i]), n_modules)  # modules run (the gate may stop early)
            for j in range(ran):  # (no row before the cache's row 0: a head started afresh
                st.committed[j] = max(n - 1 - j, st.offset)  # on fewer rows than modules)
            for j in range(ran, min(ks[i], n_modules)):  # rewound to starts[i], not run
                st.committed[j] = min(st.committed[j], starts[i])
            keep = min(st.committed)
            st.hist.drop_before(keep)
            st.base = keep
        return Drafts(
            [np.asarray(t, dtype=np.int64) for t in tokens],
            [None if not p or p[0] is None else np.stack(p) for p in probs],
        )
