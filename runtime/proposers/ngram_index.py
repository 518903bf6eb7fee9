"""Where every recent n-gram last occurred, kept as tokens arrive: a lookup reads a few dict
entries instead of scanning the history (the scan, `ngram_match`, is the reference).

    extend(tokens)        the current sequence grows; each n-gram (min_n..max_n tokens) that
                          now has a successor maps to the position after it (the most recent
                          occurrence wins)
    end_sequence()        later tokens start a sequence of their own: no n-gram spans two,
                          and a match's run stops at the end of its sequence
    drop_oldest()         the oldest sequence leaves (the suffix cache's bound): the n-grams
                          whose most recent occurrence was in it are forgotten, so memory
                          stays bounded by the tokens kept
    match(context, k)     up to k tokens that followed the most recent occurrence of the
                          longest suffix of `context`, max_n down to min_n tokens
"""

from __future__ import annotations

from collections import deque

END = -1  # after each ended sequence: a run stops there


class NgramIndex:
    def __init__(self, min_n: int, max_n: int):
        assert 1 <= min_n <= max_n, (min_n, max_n)
        self.min_n, self.max_n = min_n, max_n
        self.tokens: list[int] = []  # tokens[i] sits at absolute position offset + i
        self.offset = 0
        self.after: dict[int, dict[tuple, int]] = {n: {} for n in range(min_n, max_n + 1)}
        self.start = 0  # absolute position where the current sequence starts
        self.indexed = 0  # n-grams ending before this absolute position are indexed
        self.lengths: deque[int] = deque()  # ended sequences' lengths, END included

    def __len__(self) -> int:
        """Tokens of the current sequence seen so far."""
        return self.offset + len(self.tokens) - self.start

    def _ngrams(self, first_end: int, last_end: int, start: int):
        """(n, n-gram, absolute position after it) for every n-gram ending at an absolute
        position in [first_end, last_end] that does not start before `start`."""
        tokens, offset = self.tokens, self.offset
        for e in range(first_end, last_end + 1):
            i = e - offset + 1
            for n in range(self.min_n, min(self.max_n, e - start + 1) + 1):
                yield n, tuple(tokens[i - n:i]), e + 1

    def extend(self, tokens) -> None:
        self.tokens.extend(int(t) for t in tokens)
        last = self.offset + len(self.tokens) - 2  # the last position with a successor
        for n, gram, pos in self._ngrams(self.indexed, last, self.start):
            self.after[n][gram] = pos
        self.indexed = max(self.indexed, last + 1)

    def end_sequence(self) -> None:
        self.tokens.append(END)
        self.lengths.append(self.offset + len(self.tokens) - self.start)
        self.start = self.indexed = self.offset + len(self.tokens)

    def drop_oldest(self) -> int:
        """Forgets the oldest ended sequence -> the tokens it held (END included)."""
        length = self.lengths.popleft()
        for n, gram, pos in self._ngrams(self.offset, self.offset + length - 3, self.offset):
            if self.after[n].get(gram) == pos:
                del self.after[n][gram]
        del self.tokens[:length]
        self.offset += length
        return length

    def match(self, context: list[int], k: int, min_n: int | None = None,
              max_n: int | None = None) -> list[int]:
        return self.match_n(context, k, min_n, max_n)[0]

    def match_n(self, context: list[int], k: int, min_n: int | None = None,
                max_n: int | None = None) -> tuple[list[int], int]:
        """(the run, the length n of the suffix that matched; 0: none did)."""
        least = self.min_n if min_n is None else max(min_n, self.min_n)
        most = self.max_n if max_n is None else min(max_n, self.max_n)
        for n in range(min(most, len(context)), least - 1, -1):
            pos = self.after[n].get(tuple(context[-n:]))
            if pos is not None:
                i = pos - self.offset
                run = self.tokens[i:i + k]
                return (run[:run.index(END)] if END in run else run), n
        return [], 0
