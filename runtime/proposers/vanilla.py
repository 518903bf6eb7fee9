"""A draft model with the target's vocabulary and its own KV cache, run autoregressively.

    catch up:  feed the tokens the draft has not seen (the whole prompt the first time; after
               that the last accepted draft and the new target token), take d1
    then:      feed d_{j-1}, take d_j, for j = 2..k       (one batched forward per j)

The draft cache mirrors, per slot, the token ids it holds; after a step, `commit` rewinds it
to the prefix that the accepted sequence shares with it (no copy: a length). The ids stay with
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


class VanillaProposer(Proposer):
    name = "vanilla"
    gated = True

    def __init__(self, draft: StepGraph, cache: KVCache, vocab: DraftVocab | None = None):
        self.draft = draft
        self.cache = cache  # same slot count as the target's; a stream uses its own slot
        self.vocab = vocab  # the head's draft vocabulary; None: the target's
        self.held: dict[int, list[int]] = {}  # slot -> the token ids in its draft cache rows

    def commit(self, s) -> None:
        tokens = self.held.get(s.slot, [])
        keep = common_prefix(tokens, s.prompt_ids + s.output_ids)
        self.cache.rewind(s.slot, keep)
        self.held[s.slot] = tokens[:keep]

    def adopt(self, s, src: int, n: int, owner: int) -> int:
        """Rows copied to another slot: the draft's rows they share with the prompt follow."""
        if src != s.slot:
            keep = common_prefix(self.held.get(src, []), s.prompt_ids[:n])
            self.cache.copy_rows(src, s.slot, keep)
            self.cache.lengths[s.slot] = keep
            self.held[s.slot] = list(s.prompt_ids[:keep])
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
            keep = common_prefix(self.held.get(s.slot, []), seq)
            if keep == len(seq):  # everything seen: re-feed the last token to get its logits
                keep -= 1
            self.cache.lengths[s.slot] = keep
            feeds[i] = seq[keep:]
            self.held[s.slot] = seq[:keep]
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
                token, q = pick_draft(s, logits[-1], self.vocab)
                tokens[i].append(token)
                probs[i].append(q)
                if gate is not None and not gate.more(i, confidence(logits[-1], q, token)):
                    stopped.add(i)
        return Drafts(
            [np.asarray(t, dtype=np.int64) for t in tokens],
            [None if not p or p[0] is None else np.stack(p) for p in probs],
        )
