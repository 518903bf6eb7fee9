"""Prefix caching: a request whose prompt starts with tokens a KV slot already holds reads only
the rest (vLLM's automatic prefix caching, llama.cpp's per-slot prompt cache).

    release(stream)          its slot keeps the token ids of its valid rows (KVCache.kept)
    admit(stream):
        hit = longest common prefix of the prompt with every kept slot and every running
              stream's cached tokens (at least `min_tokens`, at most len(prompt) - 1: the
              last prompt token is always read, for its logits)
        kept slot    -> the stream takes that slot; its rows [0, n) stay valid
        running slot -> the stream takes a free slot and the n rows are copied into it
                        (concurrent requests sharing a prefix do not queue behind each other)
        the stream's prefill starts at n (its drafter may ask to start a few rows earlier)

Which free slot a request writes (runtime/prefix_cache.py `take`, docs/serving.md): an empty
one, else the kept record whose loss costs the fewest re-read tokens (tokens no other kept
record holds; least recently kept among equals). A hit on a kept record longer than the hit
copies its rows into that slot instead of taking the record's own, unless that would lose
more than cutting the record does. Which rows a
slot holds is tracked by token ids, so a hit is exact: the rows are the ones the prompt would
write. Greedy output with a hit equals output without it when decoding is exact (a row's
logits do not depend on how many rows its step reads); with `--fast-decode` a near-tie can
go either way, as between any two batchings.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from trt_spec.runtime.kv_cache import KVCache

MIN_TOKENS = 8  # shorter shared prefixes are read again (a hit has bookkeeping of its own)


def common_prefix(a, b) -> int:
    """Length of the longest common prefix of two token id sequences."""
    n = min(len(a), len(b))
    if n == 0:
        return 0
    diff = np.flatnonzero(np.asarray(a[:n]) != np.asarray(b[:n]))
    return int(diff[0]) if diff.size else n


@dataclass(frozen=True)
class PrefixHit:
    slot: int  # the slot whose rows [0, tokens) the prompt shares
    tokens: int  # how many
    kept: bool  # a free kept slot (taken as it is) or a running stream's (its rows copied)
    owner: int  # the stream that wrote those rows


@dataclass
class PrefixStats:
    """Totals since load, as data (for callers and tests; the server's /metrics counts the
    same from each admitted request's cached_tokens)."""

    lookups: int = 0  # prompts admitted with the prefix cache on
    hits: int = 0  # ... that started from cached rows
    prompt_tokens: int = 0  # their prompt tokens
    cached_tokens: int = 0  # ... not read again
    copied_rows: int = 0  # rows copied from a running stream's slot

    @property
    def hit_rate(self) -> float:
        return self.hits / self.lookups if self.lookups else 0.0


class PrefixCache:
    """Finds the cached rows a prompt can start from; the KVCache keeps them."""

    def __init__(self, cache: KVCache, min_tokens: int = MIN_TOKENS):
        if not isinstance(min_tokens, int) or min_tokens < 1:
            raise ValueError(f"prefix cache min_tokens={min_tokens!r}: must be an integer >= 1")
        self.cache = cache
        self.min_tokens = min_tokens
        self.stats = PrefixStats()

    def find(self, prompt: list[int], running: dict[int, tuple[int, list[int]]]
             ) -> PrefixHit | None:
        """The longest usable prefix of `prompt` among the kept slots and `running` (slot ->
        (stream id, the token ids of its valid rows)); None below min_tokens. Ties go to a kept
        slot (nothing to copy)."""
        limit = len(prompt) - 1  # the last prompt token is read again for its logits
        ids = np.asarray(prompt)
        candidates = [(slot, k.tokens, True, k.owner) for slot, k in self.cache.kept.items()]
        candidates += [(slot, tokens, False, owner) for slot, (owner, tokens) in running.items()]
        best: PrefixHit | None = None
        for slot, tokens, kept, owner in candidates:  # kept first: a tie keeps the kept slot
            n = min(common_prefix(tokens, ids), limit)
            if n >= self.min_tokens and (best is None or n > best.tokens):
                best = PrefixHit(slot, n, kept, owner)
        return best

    def unique(self, slot: int, keep: int = 0) -> int:
        """Tokens of slot's kept record past its first `keep` that no other kept record
        holds: what later prompts would read again if those rows went."""
        tokens = self.cache.kept[slot].tokens
        shared = max((common_prefix(tokens, k.tokens) for s, k in self.cache.kept.items()
                      if s != slot), default=0)
        return max(len(tokens) - max(shared, keep), 0)

    def victim(self, exclude: int | None = None) -> tuple[int, int] | None:
        """(the free slot to write, the tokens its loss costs): an empty one, else the kept
        record whose loss costs the fewest re-read tokens (the least recently kept among
        equals); None when no slot is free."""
        free = [s for s in self.cache.free if s != exclude]
        empty = [s for s in free if s not in self.cache.kept]
        if empty:
            return empty[-1], 0
        kept = [s for s in self.cache.kept if s in free]  # least recently kept first
        if not kept:
            return None
        losses = [self.unique(s) for s in kept]
        best = int(np.argmin(losses))
        return kept[best], losses[best]

    def take(self, hit: PrefixHit | None) -> int:
        """Allocates the slot for a request with `hit` (None: the free slot whose loss costs
        least) and copies the hit's rows in where they are not the slot's own: a running
        stream's, or a kept record longer than the hit when another free slot costs less to
        overwrite than the record's rows past the hit (a short shared prefix, a system
        prompt, must not destroy a long chat's record). -> the slot; its length is the
        caller's."""
        if hit is None:
            victim = self.victim()
            return self.cache.allocate(None if victim is None else victim[0])
        if hit.kept:
            victim = self.victim(exclude=hit.slot)
            if victim is None or victim[1] >= self.unique(hit.slot, hit.tokens):
                return self.cache.allocate(hit.slot)  # taken as it is: nothing of worth lost
            slot = self.cache.allocate(victim[0])
        else:
            slot = self.cache.allocate(self.victim()[0])
        self.cache.copy_rows(hit.slot, slot, hit.tokens)
        self.stats.copied_rows += hit.tokens
        return slot

    def record(self, prompt_tokens: int, cached: int) -> None:
        self.stats.lookups += 1
        self.stats.prompt_tokens += prompt_tokens
        if cached:
            self.stats.hits += 1
            self.stats.cached_tokens += cached
