"""A static n-gram table of answers (REST-style retrieval drafting): what most often came
next after the last n tokens, in a corpus of assistant answers.

    build_table(sequences)      every n-gram of 1..max_n tokens seen at least `min_total`
                                times -> its most frequent next token and that token's share
    CorpusTable.chain(ctx, k)   up to k tokens: the longest order (max_n down to min_n) whose
                                n-gram ends the context gives the next token; it is appended
                                and the lookup repeats; stops where the share is < min_prob

The stream's own n-gram lookup finds what the prompt and the answer so far repeat; this
table finds the phrases answers share ("Here are some", "import numpy as np\\nimport
pandas as pd"): free to draft, a few microseconds a token. The suffix lookup (suffix.py)
asks it where the stream's own tokens match nothing longer than one token. Export writes
the table into an engine folder (export/corpus.py), the runtime reads it: a contract module.

N-grams are keyed by a 64-bit polynomial hash of their tokens read backwards (last token
first) plus the order, so one pass per order hashes every window of the corpus (numpy) and a
lookup hashes the context's suffixes of every order in one loop. The table is a sorted key
array: a lookup is one searchsorted of max_n keys.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

MASK = (1 << 64) - 1
SEED = 0x243F6A8885A308D3
MUL = 0x9E3779B97F4A7C15  # odd: the fold is a bijection of each step's state
ORDER = 0xC2B2AE3D27D4EB4F  # keys of different orders differ by multiples of this
PROB_SCALE = 255  # shares are stored as uint8


def context_keys(context, max_n: int) -> list[int]:
    """The keys of the context's last 1..max_n tokens (fewer where the context is shorter)."""
    h, keys = SEED, []
    for n in range(1, min(max_n, len(context)) + 1):
        h = (h * MUL + int(context[-n]) + 1) & MASK
        keys.append((h + n * ORDER) & MASK)
    return keys


def window_keys(tokens: np.ndarray, max_n: int):
    """Per order n = 1..max_n: (n, keys of the windows of n tokens ending at positions
    n-1 .. len-1), each equal to context_keys of that window."""
    t = tokens.astype(np.uint64) + np.uint64(1)
    h = np.full(len(tokens), SEED, dtype=np.uint64)
    with np.errstate(over="ignore"):
        for n in range(1, max_n + 1):
            if n > len(tokens):
                return
            h[n - 1:] = h[n - 1:] * np.uint64(MUL) + t[:len(tokens) - n + 1]
            yield n, h[n - 1:] + np.uint64((n * ORDER) & MASK)


def build_table(sequences, max_n: int = 8, min_total: int = 3, min_prob: float = 0.2
                ) -> dict[str, np.ndarray]:
    """sequences: token id lists (answers) -> {"keys" uint64 sorted, "tokens" uint32,
    "probs" uint8}: per n-gram seen >= min_total times (followed by a token of the same
    sequence) whose most frequent successor has a share >= min_prob."""
    if not 1 <= max_n <= 16:
        raise ValueError(f"max_n {max_n}: must be in 1..16")
    seqs = [np.asarray(s, dtype=np.int64) for s in sequences if len(s) > 1]
    if not seqs:
        return {"keys": np.zeros(0, np.uint64), "tokens": np.zeros(0, np.uint32),
                "probs": np.zeros(0, np.uint8)}
    sep = -1  # between sequences: no window or successor spans two
    tokens = np.concatenate([np.append(s, sep) for s in seqs])
    seps = np.concatenate([[0], np.cumsum(tokens == sep)])
    keys_out, tokens_out, probs_out = [], [], []
    for n, keys in window_keys(tokens, max_n):
        # the window ending at e = n-1+i, followed by tokens[e + 1]; the last has no successor
        keys = keys[:-1]
        nxt = tokens[n:]
        ok = (seps[n:len(tokens)] == seps[:len(tokens) - n]) & (nxt != sep)
        keys, nxt = keys[ok], nxt[ok]
        if not len(keys):
            continue
        order = np.lexsort((nxt, keys))
        keys, nxt = keys[order], nxt[order]
        first = np.ones(len(keys), bool)
        first[1:] = (keys[1:] != keys[:-1]) | (nxt[1:] != nxt[:-1])
        starts = np.flatnonzero(first)
        counts = np.diff(np.append(starts, len(keys)))
        pair_keys, pair_next = keys[starts], nxt[starts]
        new_key = np.ones(len(pair_keys), bool)
        new_key[1:] = pair_keys[1:] != pair_keys[:-1]
        group = np.cumsum(new_key) - 1
        totals = np.bincount(group, weights=counts).astype(np.int64)
        by_count = np.lexsort((-counts, group))  # each group's most frequent successor first
        best = by_count[np.flatnonzero(np.r_[True, group[by_count][1:] != group[by_count][:-1]])]
        share = counts[best] / totals
        keep = (totals >= min_total) & (share >= min_prob)
        keys_out.append(pair_keys[best][keep])
        tokens_out.append(pair_next[best][keep])
        probs_out.append(share[keep])
    keys = np.concatenate(keys_out)
    order = np.argsort(keys, kind="stable")
    return {"keys": keys[order],
            "tokens": np.concatenate(tokens_out)[order].astype(np.uint32),
            "probs": np.round(np.concatenate(probs_out)[order] * PROB_SCALE).astype(np.uint8)}


class CorpusTable:
    def __init__(self, table: dict[str, np.ndarray], max_n: int = 8):
        self.keys = np.asarray(table["keys"], dtype=np.uint64)
        self.tokens = np.asarray(table["tokens"], dtype=np.int64)
        self.probs = np.asarray(table["probs"], dtype=np.float64) / PROB_SCALE
        if not len(self.keys) == len(self.tokens) == len(self.probs):
            raise ValueError("corpus table: keys, tokens and probs differ in length")
        if len(self.keys) > 1 and not bool(np.all(self.keys[1:] >= self.keys[:-1])):
            raise ValueError("corpus table: keys are not sorted")
        self.max_n = int(max_n)

    def __len__(self) -> int:
        return len(self.keys)

    @classmethod
    def load(cls, path: str | Path) -> "CorpusTable":
        with np.load(path) as z:
            missing = {"keys", "tokens", "probs", "max_n"} - set(z.files)
            if missing:
                raise ValueError(f"{path}: not a corpus table (no {', '.join(sorted(missing))})")
            return cls({k: z[k] for k in ("keys", "tokens", "probs")}, int(z["max_n"]))

    def save(self, path: str | Path) -> None:
        with open(path, "wb") as f:
            np.savez_compressed(f, keys=self.keys, tokens=self.tokens.astype(np.uint32),
                                probs=np.round(self.probs * PROB_SCALE).astype(np.uint8),
                                max_n=np.int64(self.max_n))

    def next(self, context, min_n: int = 2) -> tuple[int, float, int] | None:
        """(token, its share, n) from the longest order >= min_n the table holds; None."""
        keys = context_keys(context, self.max_n)[min_n - 1:]
        if not keys or not len(self.keys):
            return None
        query = np.asarray(keys, dtype=np.uint64)
        at = np.minimum(np.searchsorted(self.keys, query), len(self.keys) - 1)
        hits = np.flatnonzero(self.keys[at] == query)
        if not len(hits):
            return None
        i = at[hits[-1]]  # the longest order found
        return int(self.tokens[i]), float(self.probs[i]), int(hits[-1]) + min_n

    def chain(self, context, k: int, min_n: int = 2, min_prob: float = 0.3
              ) -> tuple[np.ndarray, list[float]]:
        """Up to k tokens, each the table's next token after the context and the tokens
        before it; stops at a share below min_prob. -> (tokens, their shares)."""
        ctx = [int(t) for t in context[-self.max_n:]]
        out: list[int] = []
        shares: list[float] = []
        while len(out) < k:
            found = self.next(ctx, min_n)
            if found is None or found[1] < min_prob:
                break
            out.append(found[0])
            shares.append(found[1])
            ctx = ctx[1:] + [found[0]] if len(ctx) >= self.max_n else ctx + [found[0]]
        return np.asarray(out, dtype=np.int64), shares
