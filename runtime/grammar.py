"""Structured outputs: a request's JSON schema, regex, grammar or choice, held by llguidance.

llguidance (a Rust library, no torch) compiles the request's structure into a matcher over the
model's tokenizer. Per stream, the engine asks its Guide for:

    forced()          the tokens the grammar allows exactly one way from here: drafted for free
                      (no drafter runs), on top of any method, `none` included
    valid(drafts)     how many of a drafter's tokens the grammar allows: the rest are cut
                      before scoring
    masks(drafts)     a bitmask per verified row (the state before each draft, and after the
                      last): rows of the target's logits are masked before verification, so
                      speculative output equals plain decoding under the same grammar (token for
                      token when greedy, in distribution when sampled)
    consume(token)    each emitted token; `done` once the grammar admits nothing more

Grammars are compiled where a request is submitted (the caller's thread, not the scheduler's),
cached by their text, and bounded: inputs past validation.MAX_STRUCTURE_BYTES are refused, and
llguidance's parser limits (`limits`) bound compile and per-token work. A structure that does not
compile is a ValueError naming the field and the library's reason, and so is one that cannot
start (its first mask is computed when it compiles: an empty language, a limit passed at once).
What only shows later (a limit passed deep in the output, a text no token spells) ends the
stream with finish_reason "error" and the Guide's `failure` saying which: the server answers
it as the request's structure's fault (a 400 naming its field), never the model's.
"""

from __future__ import annotations

import json
import threading
import time
from collections import OrderedDict
from contextlib import contextmanager

import numpy as np

from trt_spec.runtime.validation import FieldError

# JSON output as OpenAI's and most servers' look: one space after ':' and ',', no newlines.
# Fixed separators make keys and punctuation forced tokens (drafted for free).
JSON_OPTIONS = {"whitespace_flexible": False, "key_separator": ": ", "item_separator": ", "}
CACHED = 64  # compiled grammars kept, by their text
# byte b of a token bitmask (bit i: token 8 j + i allowed) -> the 8 additive terms of its tokens
BYTE_TERMS = np.where(np.unpackbits(np.arange(256, dtype=np.uint8)[:, None], axis=1,
                                    bitorder="little") == 1, 0.0, -np.inf).astype(np.float32)


def lark_choice(choices: tuple[str, ...]) -> str:
    """A Lark grammar whose language is exactly `choices` (JSON string literals), as one
    terminal: the lexer holds them as one automaton, where alternatives of the rule would be
    parser items, one each (2,000 choices passed llguidance's 2,000 items in a row)."""
    return "start: CHOICE\nCHOICE: " + " | ".join(json.dumps(c) for c in choices)


def grammar_text(kind: str, value) -> str:
    """llguidance's grammar (its JSON form) for one structure of SamplingParams."""
    from llguidance import LLMatcher

    if kind == "json_schema":
        return LLMatcher.grammar_from_json_schema(value, overrides=JSON_OPTIONS)
    if kind == "regex":
        return LLMatcher.grammar_from_regex(value)
    if kind == "grammar":
        return LLMatcher.grammar_from_lark(value)
    return LLMatcher.grammar_from_lark(lark_choice(value))


def limits():
    """llguidance's bounds on compile and per-token work (its defaults, errors in full)."""
    from llguidance import LLParserLimits

    return LLParserLimits(verbose_errors=True)


class TokenTable:
    """A tokenizer as llguidance's TokenizerWrapper reads it (each token's bytes, and
    encoding), for tokenizers whose tokenizer.json llguidance cannot read itself (no decoder:
    the tests' word-level tokenizer)."""

    def __init__(self, tokenizer, vocab_size: int, eos_ids: list[int]):
        self.eos_token_id = eos_ids[0]
        self.bos_token_id = None
        self.tokens = [tokenizer.token_bytes(i) for i in range(vocab_size)]
        self.special_token_ids = list(eos_ids)
        self._ids = {}
        for i, b in enumerate(self.tokens):
            if b and i not in eos_ids:
                self._ids.setdefault(b, i)
        self._longest = max(map(len, self._ids), default=1)

    def __call__(self, text) -> list[int]:
        """Greedy longest-match over the tokens' bytes (the grammar sees tokens
        concatenated)."""
        data = text if isinstance(text, bytes) else text.encode()
        ids, i = [], 0
        while i < len(data):
            for n in range(min(self._longest, len(data) - i), 0, -1):
                if data[i:i + n] in self._ids:
                    ids.append(self._ids[data[i:i + n]])
                    i += n
                    break
            else:
                i += 1  # a byte no token spells: skipped
        return ids


class Grammars:
    """An engine's structured outputs: the tokenizer in llguidance's form (built on first use,
    ~0.4 s for a 49k vocabulary) and compiled grammars, cached by their text."""

    def __init__(self, tokenizer, vocab_size: int, eos_ids: list[int]):
        """tokenizer: the engine's (runtime/tokenizer.py)."""
        self.source = tokenizer
        self.vocab_size = vocab_size
        self.eos_ids = sorted(eos_ids)
        self._tokenizer = None
        self._cache: OrderedDict[tuple, object] = OrderedDict()  # key -> compiled matcher
        self._lock = threading.Lock()

    @property
    def tokenizer(self):
        with self._lock:
            if self._tokenizer is None:
                try:
                    from llguidance import LLTokenizer, TokenizerWrapper
                except ImportError as e:
                    raise ValueError(f"structured outputs need llguidance ({e}); pip install "
                                     "llguidance") from None
                try:  # llguidance reads tokenizer.json itself (byte-level BPE, SentencePiece)
                    self._tokenizer = LLTokenizer(self.source.to_json(), n_vocab=self.vocab_size,
                                                  eos_token=self.eos_ids)
                except ValueError:  # else from each token's bytes
                    table = TokenTable(self.source, self.vocab_size, self.eos_ids)
                    self._tokenizer = LLTokenizer(TokenizerWrapper(table),
                                                  n_vocab=self.vocab_size,
                                                  eos_token=self.eos_ids)
            return self._tokenizer

    def compile(self, kind: str, value):
        """A fresh matcher for (kind, value); FieldError(kind) where it does not compile."""
        from llguidance import LLMatcher

        key = (kind, value)
        with self._lock:
            proto = self._cache.get(key)
            if proto is not None:
                self._cache.move_to_end(key)
        if proto is None:
            tokenizer = self.tokenizer
            try:
                text = grammar_text(kind, json.loads(value) if kind == "json_schema" else value)
            except ValueError as e:
                raise FieldError(kind, f"{kind}: {e}") from None
            is_error, messages = LLMatcher.validate_grammar_with_warnings(text, tokenizer,
                                                                          limits=limits())
            if is_error:
                raise FieldError(kind, f"{kind} does not compile: {first_line(messages[0])}")
            proto = LLMatcher(tokenizer, text, log_level=0, limits=limits())
            if proto.is_error():
                raise FieldError(kind, f"{kind} does not compile: {first_line(proto.get_error())}")
            check_start(kind, proto, self.vocab_size)
            with self._lock:
                self._cache[key] = proto
                while len(self._cache) > CACHED:
                    self._cache.popitem(last=False)
        return proto.deep_copy()

    def guide(self, params, steer: bool = True) -> "Guide | None":
        """The Guide of a request's SamplingParams, None where it asks for no structure.
        steer: model drafters draft under its mask (SpeculationConfig.grammar_drafts)."""
        structure = params.structure
        if structure is None:
            return None
        return Guide(self.compile(*structure), self.vocab_size, self.eos_ids, steer)


def check_start(kind: str, proto, vocab_size: int) -> None:
    """FieldError(kind) where the structure cannot start: its language is empty (a regex
    no text matches, a grammar or schema whose every rule recurses), or the first token's
    mask already passes the engine's limits. What only shows later ends the stream
    (Guide.failure)."""
    from llguidance.numpy import fill_next_token_bitmask

    probe = proto.deep_copy()
    fill_next_token_bitmask(probe, np.zeros((1, (vocab_size + 31) // 32), dtype=np.int32), 0)
    if not probe.is_error():
        return
    reason = first_line(probe.get_error())
    if reason.startswith(EMPTY):
        raise FieldError(kind, f"{kind}: no text matches it (its language is empty), so no "
                               "output can follow it")
    if past_limit(reason):
        raise FieldError(kind, f"{kind} cannot start within the grammar engine's limits: "
                               f"{reason}")
    raise FieldError(kind, f"{kind} cannot start: {reason}")


# Guide.failure's two kinds: the structure's own, or the engine's limits
DEAD_END = "no token of this model's vocabulary can continue it from here"
LIMIT = "it passed the grammar engine's limits"
def past_limit(error: str) -> bool:
    """llguidance's error says one of its limits was passed (items in a row, lexer fuel,
    lexer states, grammar size)."""
    text = error.lower()
    return any(word in text for word in ("max is", "fuel", "limit", "too many", "too big"))


# llguidance's error where nothing at all can be produced (the matcher's message then goes
# on with its state)
EMPTY = "NoExtensionBias"


def first_line(message: str, limit: int = 300) -> str:
    """llguidance's message on one line, at most `limit` characters (without the matcher's
    state, which follows its reason)."""
    message = message.split("<state>")[0]
    text = " ".join(line.strip() for line in message.strip().splitlines() if line.strip())
    return (text[:limit - 3] + "...") if len(text) > limit else (text or "unknown error")


class Guide:
    """One stream's grammar state (an llguidance matcher) and the time its masks took."""

    def __init__(self, matcher, vocab_size: int, eos_ids: list[int], steer: bool = True):
        """steer: model drafters draft under this guide's mask (`allowed`)."""
        self.matcher = matcher
        self.steer = steer
        self.eos_ids = eos_ids
        self.vocab_size = vocab_size
        self.words = (vocab_size + 31) // 32
        self.mask_s = 0.0  # seconds spent computing and applying masks
        self.masks_made = 0
        # why the output could not go on (consume refused a token), None while it can: the
        # engine's reason where a limit was passed, else DEAD_END
        self.failure: str | None = None

    @property
    def done(self) -> bool:
        """The grammar admits no more tokens (EOS at most): the output is complete."""
        return self.matcher.is_stopped()

    def forced(self, limit: int) -> list[int]:
        """At most `limit` tokens the grammar allows exactly one way from here."""
        return list(self.matcher.compute_ff_tokens()[:limit]) if limit > 0 else []

    @contextmanager
    def ahead(self, drafts):
        """The matcher moved past `drafts` for the block's length, then rolled back: yields
        False (not moved) where a draft is not valid or one is an EOS (nothing follows an
        EOS, and llguidance 1.9.1 cannot roll a consumed EOS back: the matcher then refuses
        the same end again)."""
        drafts = [int(t) for t in drafts]
        if any(t in self.eos_ids for t in drafts) or \
                (drafts and self.matcher.validate_tokens(drafts) < len(drafts)):
            yield False
            return
        for t in drafts:
            self.matcher.consume_token(t)
        try:
            yield True
        finally:
            if drafts:
                self.matcher.rollback(len(drafts))

    def forced_after(self, drafts, limit: int) -> list[int]:
        """At most `limit` tokens the grammar allows exactly one way after `drafts`; [] after
        an EOS or an invalid draft. The matcher is left where it was."""
        if limit <= 0:
            return []
        with self.ahead(drafts) as moved:
            if not moved:
                return []
            tokens = list(self.matcher.compute_ff_tokens()[:limit])
            return tokens[:self.matcher.validate_tokens(tokens)] if tokens else []

    def valid(self, drafts) -> int:
        """How many of `drafts` (from here on) the grammar allows."""
        return self.matcher.validate_tokens([int(t) for t in drafts]) if len(drafts) else 0

    def allowed(self, drafted) -> np.ndarray | None:
        """bool [vocab]: the tokens allowed after the output and `drafted` (the drafts before
        this one in the step); None where a draft is not valid or nothing is allowed. The
        matcher is left where it was."""
        from llguidance.numpy import fill_next_token_bitmask

        t0 = time.perf_counter()
        with self.ahead(drafted) as moved:
            if not moved:
                return None
            bits = np.zeros((1, self.words), dtype=np.int32)
            fill_next_token_bitmask(self.matcher, bits, 0)
        out = np.unpackbits(bits.view(np.uint8), bitorder="little")[:self.vocab_size] == 1
        self.mask_s += time.perf_counter() - t0
        return out if out.any() else None

    def masks(self, drafts) -> np.ndarray:
        """[len(drafts) + 1, words] int32 bitmasks: the state here, then after each draft
        (every draft must be valid: `valid`). The matcher is left where it was."""
        from llguidance.numpy import fill_next_token_bitmask

        t0 = time.perf_counter()
        out = np.zeros((len(drafts) + 1, self.words), dtype=np.int32)
        consumed = 0
        for j in range(len(drafts) + 1):
            fill_next_token_bitmask(self.matcher, out, j)
            if j == len(drafts) or int(drafts[j]) in self.eos_ids:
                break  # nothing follows an EOS, and it is never consumed here (`ahead`)
            if not self.matcher.consume_token(int(drafts[j])):
                if self.matcher.is_error() and past_limit(first_line(self.matcher.get_error())):
                    # past one of the engine's limits on the way: the rows after allow EOS
                    # only, which the grammar refuses: this stream ends (Guide.failure)
                    break
                raise AssertionError(f"draft {int(drafts[j])} was not valid: "
                                     f"{self.matcher.get_error()}")
            consumed += 1
        if consumed:
            self.matcher.rollback(consumed)
        for row in np.flatnonzero(~out.any(axis=1)):
            # nothing allowed (a dead end, or the matcher past a limit): EOS, which the
            # grammar then refuses, so the stream ends with finish_reason "error"
            for eos in self.eos_ids:
                out[row, eos // 32] |= np.int32(1 << (eos % 32)) if eos % 32 < 31 else \
                    np.int32(-2**31)
        self.mask_s += time.perf_counter() - t0
        self.masks_made += len(drafts) + 1
        return out

    def apply(self, logits: np.ndarray, masks: np.ndarray) -> None:
        """Sets the logits of disallowed tokens to -inf, in place, row by row (logits
        [rows >= len(masks), vocab]; rows past the masks are left as they are). Each mask
        byte is looked up as 8 additive terms (0 or -inf): ~20 us a row for 49k tokens,
        whatever the mask (a boolean index costs 35-250 us, by how the bits fall)."""
        t0 = time.perf_counter()
        n, width = len(masks), logits.shape[-1]
        add = np.take(BYTE_TERMS, masks.view(np.uint8), axis=0).reshape(n, -1)
        np.add(logits[:n], add[:, :width], out=logits[:n])
        self.mask_s += time.perf_counter() - t0

    def consume(self, token: int) -> bool:
        """An emitted token (chosen under this guide's masks). False where the grammar cannot
        go on: a dead end (no token spells what it needs next), or the matcher past one of
        the engine's limits (`limits`); `failure` says which."""
        if self.matcher.consume_token(int(token)) and not self.matcher.is_error():
            return True
        error = first_line(self.matcher.get_error()) if self.matcher.is_error() else ""
        self.failure = f"{LIMIT}: {error}" if past_limit(error) else \
            DEAD_END + (f" ({error})" if error and not error.startswith(EMPTY) else "")
        return False
