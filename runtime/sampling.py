"""Sampling parameters and the logits -> token step shared by every engine.

`probs_from_logits` is the one place temperature, top-k and top-p are applied, so a
speculative sampler can apply them identically to the target (p) and the draft (q). Its torch
twin, for the torch backends (batched, one setting per row), is runtime/sampling_torch.py.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from trt_spec.runtime import validation as v

MAX_LOGPROBS = 20  # most likely alternatives per token, as OpenAI's top_logprobs


@dataclass(frozen=True)
class SamplingParams:
    """Names follow vLLM's SamplingParams. temperature 0 means greedy."""

    max_tokens: int = 128  # 0: no new token, the prompt is only read (for prompt_logprobs)
    temperature: float = 0.0
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1: off
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    # None: no logprobs; n >= 0: each emitted token's log-probability under the target and
    # its n most likely alternatives (vLLM's meaning; OpenAI's top_logprobs)
    logprobs: int | None = None
    # None: none; n >= 0: each prompt token's log-probability given the tokens before it (the
    # first has none) and its n most likely alternatives, from the prefill's own logits
    # (vLLM's prompt_logprobs); such a prompt is read whole, never from the prefix cache
    prompt_logprobs: int | None = None
    # structured output (runtime/grammar.py), at most one: the output is held to a JSON schema
    # (a dict or its JSON text; kept as JSON text), a regular expression, a grammar
    # in llguidance's Lark dialect, or one of a list of strings
    json_schema: str | None = None
    regex: str | None = None
    grammar: str | None = None
    choice: tuple[str, ...] = ()  # (): none

    def __post_init__(self):
        """Every field checked, types included (runtime/validation.py: the server's checks
        too); a FieldError (a ValueError) names the field and what is allowed."""
        set_ = object.__setattr__
        set_(self, "max_tokens", v.integer("max_tokens", self.max_tokens, 0,
                                           allowed=" (0: the prompt is only read)"))
        set_(self, "temperature", v.real("temperature", self.temperature, ">= 0 (0 = greedy)",
                                         lo=0))
        set_(self, "top_k", v.integer("top_k", self.top_k, 0, allowed=" (0 = off)"))
        set_(self, "top_p", v.real("top_p", self.top_p, "in (0, 1] (1 = off)", lo=0, hi=1,
                                   lo_open=True))
        set_(self, "seed", v.seed(self.seed))
        set_(self, "stop", v.strings("stop", self.stop, "a string or a list of strings "
                                                        "(() for none)"))
        if any(not s for s in self.stop):
            raise v.FieldError("stop", f"stop={self.stop!r}: stop strings must be non-empty")
        ids = self.stop_token_ids
        if not isinstance(ids, (list, tuple)):
            raise v.FieldError("stop_token_ids", f"stop_token_ids={ids!r}: expected a list of "
                                                 "token ids")
        set_(self, "stop_token_ids", tuple(v.integer("stop_token_ids", t, 0) for t in ids))
        set_(self, "ignore_eos", v.flag("ignore_eos", self.ignore_eos))
        set_(self, "logprobs", None if self.logprobs is None else
             v.integer("logprobs", self.logprobs, 0, MAX_LOGPROBS,
                       " (None: none; 0: the chosen token's only)"))
        set_(self, "prompt_logprobs", None if self.prompt_logprobs is None else
             v.integer("prompt_logprobs", self.prompt_logprobs, 0, MAX_LOGPROBS,
                       " (None: none; 0: each prompt token's only)"))
        set_(self, "json_schema", v.json_schema(self.json_schema))
        set_(self, "regex", v.text("regex", self.regex))
        set_(self, "grammar", v.text("grammar", self.grammar))
        set_(self, "choice", v.choice(self.choice))
        v.one_structure({k: getattr(self, k) for k in v.STRUCTURES})

    @property
    def structure(self) -> tuple[str, str | tuple[str, ...]] | None:
        """(kind, value) of the structured output asked for (kind: json_schema, regex, grammar
        or choice), or None."""
        return next(((k, getattr(self, k)) for k in v.STRUCTURES if getattr(self, k)), None)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def probs_from_logits(logits: np.ndarray, temperature: float, top_k: int = 0,
                      top_p: float = 1.0) -> np.ndarray:
    """logits: [..., vocab] -> probabilities [..., vocab] (float64). The steps, in order
    (runtime/sampling_torch.py's probs_from_logits takes the same ones, batched per row):

        temperature   z = logits / T                                         T > 0
        top-k         keep the k largest z (ties with the k-th kept too)      k = 0: off
        softmax
        top-p         keep the smallest set of tokens, most likely first, whose
                      probability reaches p (the first token always stays)    p = 1: off

    A new per-request control is one more step here and one there, at the same place in the
    order; tests/test_sampling_torch.py holds the two to each other."""
    assert temperature > 0, temperature
    # every step in place on one float64 copy: a full-vocabulary temporary per operation
    # cost ~3x the arithmetic (fresh pages each time)
    x = logits.astype(np.float64)
    np.divide(x, temperature, out=x)
    mask_top_k_(x, top_k)
    softmax_(x)
    return keep_top_p(x, top_p)


def mask_top_k_(z: np.ndarray, top_k: int) -> None:
    """z: [..., vocab], in place: every value below the k-th largest becomes -inf (0, or
    k >= vocab: off)."""
    if 0 < top_k < z.shape[-1]:
        kth = np.partition(z, -top_k, axis=-1)[..., -top_k, None]
        z[z < kth] = -np.inf


def softmax_(z: np.ndarray) -> None:
    """z: [..., vocab] float64, in place: softmax over the last axis (-inf -> 0)."""
    np.subtract(z, z.max(-1, keepdims=True), out=z)
    np.exp(z, out=z)
    np.divide(z, z.sum(-1, keepdims=True), out=z)


def keep_top_p(p: np.ndarray, top_p: float) -> np.ndarray:
    """p: [..., vocab] probabilities -> p renormalised over its top-p set: a token stays if
    the mass of the tokens before it, most likely first (ties: the lower index first), is
    < top_p. top_p = 1: p itself."""
    if top_p >= 1.0:
        return p
    order = np.argsort(-p, axis=-1, kind="stable")
    sorted_p = np.take_along_axis(p, order, -1)
    keep_sorted = (np.cumsum(sorted_p, -1) - sorted_p) < top_p
    keep = np.empty_like(keep_sorted)
    np.put_along_axis(keep, order, keep_sorted, -1)
    p = np.where(keep, p, 0.0)
    p /= p.sum(-1, keepdims=True)
    return p


SAMPLE_BLOCK = 256  # sample_from_probs: the CDF is walked over blocks of this many tokens


def sample_from_probs(p: np.ndarray, rng: np.random.Generator) -> int:
    """p: [vocab] nonnegative weights -> one token id with probability p / sum(p) (inverse
    CDF; one uniform draw, reproducible for a seeded rng). The CDF is found in two levels,
    the blocks' sums, then within the one block the draw lands in: a running sum over the
    whole vocabulary is sequential in NumPy and cost ~4x the rest of sampling. A token of
    weight 0 is never returned."""
    n = len(p)
    whole = n - n % SAMPLE_BLOCK
    sums = p[:whole].reshape(-1, SAMPLE_BLOCK).sum(1)
    if whole < n:
        sums = np.append(sums, p[whole:].sum())
    cdf = np.cumsum(sums)
    u = rng.random() * cdf[-1]
    b = int(min(np.searchsorted(cdf, u, side="right"), len(cdf) - 1))
    if b:
        u -= cdf[b - 1]
    block = p[b * SAMPLE_BLOCK:(b + 1) * SAMPLE_BLOCK]
    i = int(np.searchsorted(np.cumsum(block), u, side="right"))
    if i >= len(block) or block[i] == 0:  # past the block's end by rounding: its last token
        i = int(np.flatnonzero(block)[-1])  # that can be drawn
    return b * SAMPLE_BLOCK + i


def next_token(logits: np.ndarray, params: SamplingParams, rng: np.random.Generator) -> int:
    """logits: [vocab] -> token id."""
    if params.greedy:
        return int(np.argmax(logits))
    return sample_from_probs(probs_from_logits(logits, params.temperature, params.top_k,
                                               params.top_p), rng)


@dataclass(frozen=True)
class TokenLogprob:
    """One emitted token's log-probability under the target (log-softmax of its raw logits,
    before temperature, top-k and top-p, as vLLM's default) and the `n` most likely tokens'."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]  # (token id, logprob), most likely first
    rank: int = 1  # 1 + how many tokens are more likely (vLLM's Logprob.rank)


def log_softmax(x: np.ndarray) -> np.ndarray:
    """[..., vocab] logits -> log-probabilities in float64 (the target's distribution as
    logprobs and `trt-spec fidelity` report it)."""
    x = x.astype(np.float64)
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def token_logprob(logits: np.ndarray, token: int, n: int) -> TokenLogprob:
    """logits: [vocab] -> the token's TokenLogprob with its n most likely alternatives."""
    return token_logprobs(logits[None], [token], n)[0]


def token_logprobs(logits: np.ndarray, tokens, n: int) -> list[TokenLogprob]:
    """logits: [rows, vocab], tokens: [rows] -> each row's token's TokenLogprob with the row's
    n most likely tokens (most likely first; ties: the lower id first). Batched: a prompt's
    logprobs are a chunk of rows at a time."""
    logp = log_softmax(logits)  # [rows, vocab]
    tokens = np.asarray(tokens, dtype=np.int64)
    own = logp[np.arange(len(tokens)), tokens]  # [rows]
    ranks = 1 + np.count_nonzero(logp > own[:, None], axis=-1)  # [rows]
    top = np.zeros((len(tokens), 0), dtype=np.int64)  # [rows, n]
    if n:
        top = np.argpartition(-logp, min(n, logp.shape[-1]) - 1, axis=-1)[:, :n]
        values = np.take_along_axis(logp, top, -1)
        top = np.take_along_axis(top, np.lexsort((top, -values), axis=-1), -1)
    return [TokenLogprob(int(t), float(v), tuple((int(i), float(row[i])) for i in ids), int(r))
            for t, v, ids, row, r in zip(tokens, own, top, logp, ranks)]
