"""Incremental detokenization for streaming: text deltas that never end in a partial UTF-8
character and never run past a stop string.

Decoding each new token on its own is wrong for byte-level BPE (a character split across
tokens decodes to U+FFFD until its last byte arrives) and for tokenizers that drop a leading
space when a token is decoded alone. So, as vLLM's detokenizer, each update decodes a short
window that starts one token group back (`prefix`), and keeps only the text after what that
group decodes to; text ending in U+FFFD waits for the next token.

A stop string cuts the text where it starts (StopChecker), so while a stream runs the
suffix that could still grow into a stop string is held back: what was sent is always a
prefix of the final text.
"""

from __future__ import annotations

from trt_spec.runtime.tokenizer import Tokenizer

REPLACEMENT = "\ufffd"


def held_back(text: str, stops: tuple[str, ...]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of a stop string."""
    n = 0
    for stop in stops:
        for j in range(min(len(stop) - 1, len(text)), n, -1):
            if text.endswith(stop[:j]):
                n = j
                break
    return n


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, stops: tuple[str, ...] = (),
                 skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.stops = stops
        self.skip = skip_special_tokens  # as the stream's text (SamplingParams)
        self.text = ""  # text of the output tokens decoded so far (whole characters only)
        self.sent = 0  # characters of the text already handed out
        self._prefix = 0  # window start (token index)
        self._read = 0  # tokens whose text is in self.text

    def update(self, ids: list[int]) -> None:
        """ids: the stream's output token ids so far (they only grow)."""
        if len(ids) == self._read:
            return
        before = self.decode(ids[self._prefix:self._read])
        after = self.decode(ids[self._prefix:])
        if len(after) > len(before) and not after.endswith(REPLACEMENT):
            self.text += after[len(before):]
            self._prefix, self._read = self._read, len(ids)

    def decode(self, ids: list[int]) -> str:
        # (the flag passed only when it is not the default: a tokenizer's decode(ids) is all
        # a stream without it needs)
        return self.tokenizer.decode(ids) if self.skip else self.tokenizer.decode(ids, False)

    def delta(self) -> str:
        """New text safe to send while the stream runs."""
        end = len(self.text) - held_back(self.text, self.stops)
        if end <= self.sent:
            return ""
        out = self.text[self.sent:end]
        self.sent = end
        return out

    def flush(self, final_text: str) -> str:
        """The rest of `final_text` (the finished stream's text, cut at a stop string)."""
        assert final_text.startswith(self.text[:self.sent]), (self.text[:self.sent], final_text)
        out = final_text[self.sent:]
        self.sent = len(final_text)
        return out
