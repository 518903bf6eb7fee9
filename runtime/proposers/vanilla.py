"""A draft model with the target's vocabulary and its own KV cache, run autoregressively.

    catch up:  feed the tokens the draft has not seen (the whole prompt the first time; after
               that the last accepted draft and the new target token), take d1
    then:      feed d_{j-1}, take d_j, for j = 2..k       (one batched forward per j)

The draft cache mirrors, per slot, the token ids it holds; after a step, `commit` rewinds it
to the prefix that the accepted sequence shares with it (no copy: a length). A catch-up of
more than `reprime` tokens (the first draft of a request, or one after the speculation policy
kept the draft off for a while) restarts the slot's draft cache on the last `reprime` tokens
only, at shifted positions (row 0 holds token `offset`): rotary attention depends on the
distance between rows, so the draft sees that window as it would at its true positions. The ids stay with
the slot when its request ends, so a later request in that slot (a prefix-cache hit, or any
prompt) catches up from what the two share. A draft exported
with --draft-vocab has a head over a draft vocabulary (`vocab`); its ids map to target ids
as Eagle3's do (pick_draft). Its input ids are target ids either way.
"""

from __future__ import annotations

import numpy as np

from trt_spec.runtime.backends.base import StepGraph
from trt_spec.runtime.kv_cache import KVCache
from trt_spec.runtime.prefix_cache import common_prefix
from trt_spec.runtime.proposers.base import (Drafts, DraftVocab, Proposer, confidence,
                                             pick_draft)
from trt_spec.runtime.step_inputs import SlotTokens


REPRIME = 64  # tokens: the longest catch-up before the draft restarts on the last ones


class VanillaProposer(Proposer):
    name = "vanilla"
    gated = True

    def __init__(self, draft: StepGraph, cache: KVCache, vocab: DraftVocab | None = None,
                 reprime: int = REPRIME):
        assert reprime >= 1, reprime
        self.draft = draft
        self.cache = cache  # same slot count as the target's; a stream uses its own slot
        self.vocab = vocab  # the head's draft vocabulary; None: the target's
        self.reprime = reprime
        self.held: dict[int, list[int]] = {}  # slot -> the token ids in its draft cache rows
        self.offsets: dict[int, int] = {}  # slot -> the position of its row 0 (its token's)
        self.fed: set[int] = set()  # slots whose cache propose wrote since their last commit

    def commit(self, s) -> None:
        if s.slot not in self.fed:  # nothing fed since the last commit: its rows still hold
            return
        self.fed.discard(s.slot)
        tokens, off = self.held.get(s.slot, []), self.offsets.get(s.slot, 0)
        keep = common_prefix(tokens, (s.prompt_ids + s.output_ids)[off:])
        self.cache.rewind(s.slot, keep)
        self.held[s.slot] = tokens[:keep]

    def adopt(self, s, src: int, n: int, owner: int) -> int:
        """Rows copied to another slot: the draft's rows they share with the prompt follow
        (rows of a restarted cache do not: the prompt is read again)."""
        if src != s.slot:
            shifted = self.offsets.get(src, 0) != 0
            keep = 0 if shifted else common_prefix(self.held.get(src, []), s.prompt_ids[:n])
            self.cache.copy_rows(src, s.slot, keep)
            self.cache.lengths[s.slot] = keep
            self.held[s.slot] = list(s.prompt_ids[:keep])
            self.offsets[s.slot] = 0
        return n

    def propose(self, streams, ks, gate=None):
        tokens = [[] for _ in streams]
        probs = [[] for _ in streams]
        active = [i for i, k in enumerate(ks) if k > 0]
        # catch up, then take d1
        requests, feeds = [], {}
        for i in active:
            s = streams[i]
            seq = s.prompt_ids + s.output_ids
            off = self.offsets.get(s.slot, 0)
            if off >= len(seq):  # a shorter request in the slot: start again
                off, self.held[s.slot] = 0, []
            keep = common_prefix(self.held.get(s.slot, []), seq[off:])
            if off + keep == len(seq):  # everything seen: re-feed the last token for its logits
                keep -= 1
            if len(seq) - off - keep > self.reprime:  # restart on the last tokens (see above)
                off, keep = len(seq) - self.reprime, 0
            self.offsets[s.slot] = off
            self.fed.add(s.slot)
            self.cache.lengths[s.slot] = keep
            feeds[i] = seq[off + keep:]
            self.held[s.slot] = seq[off:off + keep]
            requests.append(SlotTokens(s.slot, feeds[i], [len(feeds[i]) - 1]))
        stopped = set()  # streams the gate stopped
        for j in range(max(ks, default=0)):
            if j > 0:
                active = [i for i in active if ks[i] > j and i not in stopped]
                requests = [SlotTokens(streams[i].slot, [tokens[i][-1]], [0]) for i in active]
                feeds = {i: [tokens[i][-1]] for i in active}
            if not active:
                break
            out = self.draft.step(self.cache, requests)
            for i, logits in zip(active, out.logits):
                s = streams[i]
                self.held[s.slot] = self.held[s.slot] + feeds[i]
                token, q = pick_draft(s, logits[-1], self.vocab, tokens[i])
                tokens[i].append(token)
                probs[i].append(q)
                if gate is not None and not gate.more(i, confidence(logits[-1], q, token)):
                    stopped.add(i)
        return Drafts(
            [np.asarray(t, dtype=np.int64) for t in tokens],
            [None if not p or p[0] is None else np.stack(p) for p in probs],
        )
