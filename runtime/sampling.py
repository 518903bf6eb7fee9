"""Sampling parameters and the logits -> token step shared by every engine.

Two functions hold every sampling control, so a speculative sampler applies them identically
to the target (p) and the draft (q) at every verified position:

    process_logits     the controls that read the tokens so far (and logit_bias): they change
                       the argmax too, so greedy decoding takes them as well
    probs_from_logits  temperature, min-p, top-k, top-p: the distribution a token is drawn from

The order, on row j of a verification [last, d1..dk], which predicts the token after the
prompt, the output so far and d1..dj (a grammar's mask, runtime/guided_step.py, comes first:
a token it forbids stays at -inf through every step):

    allowed_token_ids   z[t] = -inf for every t not in the list
    bad_words_ids       z[w[-1]] = -inf for each word w whose other tokens end the row's
                        output (a one-token word: always)
    min_tokens          z[t] = -inf for the end tokens (EOS, stop_token_ids) while the row's
                        output is shorter than min_tokens
    logit_bias          z[t] += bias[t]
    repetition_penalty  z[t] / r if z[t] > 0 else z[t] * r, for t in the prompt or the row's
                        output (vLLM's definition)
    frequency_penalty   z[t] -= f * count[t], count over the row's output (OpenAI's)
    presence_penalty    z[t] -= pp * (count[t] > 0)
    temperature         z / T                                  (greedy: argmax of z instead)
    min-p               drop t where p(t) < min_p * max p
    top-k, softmax, top-p

(vLLM's order.) Their torch twin, for the torch backends (batched, one setting per row), is
runtime/sampling_torch.py (the masks: its `mask`), which the device executor applies per
cache slot (runtime/device/controls.py).

Bounds. Every value SamplingParams accepts keeps the logits finite through every step above,
in float32 (the torch path's dtype) for logits of magnitude up to ~1e4: a temperature below
GREEDY_TEMPERATURE (1e-5, vLLM's epsilon) is greedy (temperature 0), so a division by it
makes at most 1e4 / 1e-5 = 1e9; repetition_penalty and temperature stay within MAX_SCALE
(1e20) and its inverse, so a penalized logit is at most 1e24 and, divided by the smallest
temperature, 1e29 (float32 holds 3.4e38; measured, a repetition_penalty below 3e-30 or above
3.4e29 overflows at temperature 1e-5, a temperature past 3.4e38 is inf in float32 and makes a
ruled-out token's -inf / inf NaN); top_p is at least 1 / MAX_SCALE (below 1.4e-45 float32
holds it as 0, which keeps no token). Past these bounds a value overflows (repetition_penalty
1e-310: z / r = inf, a distribution of NaN) or only saturates, behaving as the bound does
within float32's precision (a temperature of 1e20 already draws uniformly, a top_p of 1e-20
already keeps the most likely token alone). min_p (0..1), the frequency and presence
penalties (-2..2) and logit_bias (-100..100) are finite everywhere in their ranges. A row
that is not finite all the same (a model's NaN) fails its stream alone (NonFiniteError,
runtime/engine.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from trt_spec.runtime import validation as v
from trt_spec.runtime.race import race

MAX_LOGPROBS = 20  # most likely alternatives per token, as OpenAI's top_logprobs
GREEDY_TEMPERATURE = 1e-5  # a temperature below this is greedy (0): vLLM's _SAMPLING_EPS
MAX_SCALE = 1e20  # the bound of temperature, repetition_penalty and 1 / top_p (see above;
# the messages of SamplingParams spell both bounds out)


class NonFiniteError(ArithmeticError):
    """One request's logits or distribution hold NaN or +inf: what the engine fails that
    request alone with (runtime/engine.py)."""


def check_finite(x: np.ndarray, what: str) -> np.ndarray:
    """x [..., vocab] logits (-inf: a token ruled out) or probabilities -> x, or
    NonFiniteError where a row's maximum is NaN or +inf: one reduction, and a NaN anywhere
    propagates through it. A row with every token at -inf passes: that is a grammar's dead
    end, which its guide reports (runtime/stream.py append)."""
    top = np.asarray(x.max(-1)).ravel()
    bad = top[np.isnan(top) | (top == np.inf)]
    if len(bad):
        raise NonFiniteError(f"{what} are not finite (a row's maximum is {bad[0]}): the "
                             "model's output or the request's sampling controls overflowed")
    return x


@dataclass(frozen=True)
class SamplingParams:
    """Names follow vLLM's SamplingParams. temperature 0 means greedy (and so does any below
    GREEDY_TEMPERATURE: it is stored as 0)."""

    max_tokens: int = 128  # 0: no new token, the prompt is only read (for prompt_logprobs)
    temperature: float = 0.0  # 0..1e20; below 1e-5: greedy (stored as 0)
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1e-20..1 (1: off)
    seed: int | None = None  # None: a fresh one when the stream is made (runtime/stream.py)
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
    # in llguidance's Lark dialect (or its JSON grammar list), or one of a list of strings
    json_schema: str | None = None
    regex: str | None = None
    grammar: str | None = None
    choice: tuple[str, ...] = ()  # (): none
    # completions per prompt (OpenAI's choices); the prompt is read once and choice i draws
    # with seed + i (runtime/scheduler.py)
    n: int = 1
    # logits controls (process_logits), OpenAI's and vLLM's definitions: a bias per token id
    # (a dict {id: bias}, kept as sorted (id, bias) pairs), penalties over the output so far
    # (frequency, presence: OpenAI's) or the prompt and output (repetition: vLLM's), and
    # min-p (probs_from_logits)
    logit_bias: tuple[tuple[int, float], ...] = ()  # (): none; bias in -100..100
    presence_penalty: float = 0.0  # -2..2 (0: off)
    frequency_penalty: float = 0.0  # -2..2 (0: off)
    repetition_penalty: float = 1.0  # 1e-20..1e20 (1: off)
    min_p: float = 0.0  # 0..1 (0: off)
    # vLLM's masks (process_logits): no end token (EOS, stop_token_ids) before min_tokens
    # output tokens, which also no stop string ends; only allowed_token_ids (() : every
    # token); none of the bad words, each a token-id sequence (the server tokenizes vLLM's
    # bad_words into them: serve/protocol.py)
    min_tokens: int = 0
    allowed_token_ids: tuple[int, ...] = ()
    bad_words_ids: tuple[tuple[int, ...], ...] = ()
    # the model's end tokens min_tokens holds back besides stop_token_ids: the engine fills
    # them in (Generator.with_model_stops), as vLLM's all_stop_token_ids
    eos_token_ids: tuple[int, ...] = ()
    # the output's text: special tokens dropped (vLLM's default) or kept; the stop string
    # that ended it cut off (OpenAI's) or kept
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False

    def __post_init__(self):
        """Every field checked, types included (runtime/validation.py: the server's checks
        too); a FieldError (a ValueError) names the field and what is allowed."""
        set_ = object.__setattr__
        set_(self, "max_tokens", v.integer("max_tokens", self.max_tokens, 0,
                                           allowed=" (0: the prompt is only read)"))
        t = v.real("temperature", self.temperature, "in 0..1e20 (below 1e-5: greedy)", lo=0,
                   hi=MAX_SCALE)
        set_(self, "temperature", 0.0 if t < GREEDY_TEMPERATURE else t)
        set_(self, "top_k", v.integer("top_k", self.top_k, 0, allowed=" (0 = off)"))
        set_(self, "top_p", v.real("top_p", self.top_p, "in 1e-20..1 (1 = off; a smaller "
                                   "top_p would keep the most likely token alone, as 1e-20 "
                                   "does)", lo=1 / MAX_SCALE, hi=1))
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
        set_(self, "n", v.integer("n", self.n, 1))
        set_(self, "logit_bias", v.logit_bias(self.logit_bias))
        for name in ("presence_penalty", "frequency_penalty"):
            set_(self, name, v.real(name, getattr(self, name), "in -2..2 (0 = off)", -2, 2))
        set_(self, "repetition_penalty", v.real(
            "repetition_penalty", self.repetition_penalty, "in 1e-20..1e20 (1 = off; past "
            "these a penalized logit overflows float32)", lo=1 / MAX_SCALE, hi=MAX_SCALE))
        set_(self, "min_p", v.real("min_p", self.min_p, "in 0..1 (0 = off)", 0, 1))
        set_(self, "min_tokens", v.integer("min_tokens", self.min_tokens, 0,
                                           allowed=" (0 = off)"))
        if self.min_tokens > self.max_tokens:
            raise v.FieldError("min_tokens", f"min_tokens={self.min_tokens}: must be at most "
                                             f"max_tokens ({self.max_tokens})")
        set_(self, "allowed_token_ids", v.token_ids("allowed_token_ids",
                                                    self.allowed_token_ids))
        set_(self, "eos_token_ids", v.token_ids("eos_token_ids", self.eos_token_ids))
        set_(self, "bad_words_ids", v.token_sequences("bad_words_ids", self.bad_words_ids))
        set_(self, "skip_special_tokens", v.flag("skip_special_tokens",
                                                 self.skip_special_tokens))
        set_(self, "include_stop_str_in_output", v.flag("include_stop_str_in_output",
                                                        self.include_stop_str_in_output))

    @property
    def structure(self) -> tuple[str, str | tuple[str, ...]] | None:
        """(kind, value) of the structured output asked for (kind: json_schema, regex, grammar
        or choice), or None."""
        return next(((k, getattr(self, k)) for k in v.STRUCTURES if getattr(self, k)), None)

    @property
    def greedy(self) -> bool:
        """temperature 0 (stored for any below GREEDY_TEMPERATURE; the test reads the bound
        too, so params built around the checks agree with the device's greedy_as_zero)."""
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def masks(self) -> bool:
        """Some mask of process_logits is on (allowed_token_ids, bad words, min_tokens)."""
        return bool(self.allowed_token_ids) or bool(self.bad_words_ids) or self.min_tokens > 0

    @property
    def processes_logits(self) -> bool:
        """Some control of process_logits is on (a mask, a bias or a penalty)."""
        return self.masks or bool(self.logit_bias) or self.presence_penalty != 0 or \
            self.frequency_penalty != 0 or self.repetition_penalty != 1

    @property
    def controls(self) -> tuple[str, ...]:
        """The names of the controls on besides temperature, top-k and top-p (what the device
        executor applies with runtime/device/controls.py)."""
        off = {"logit_bias": (), "presence_penalty": 0, "frequency_penalty": 0,
               "repetition_penalty": 1, "min_p": 0, "min_tokens": 0, "allowed_token_ids": (),
               "bad_words_ids": ()}
        return tuple(k for k, v in off.items() if getattr(self, k) != v)


def process_logits(logits: np.ndarray, params: SamplingParams, prompt_ids, output_ids,
                   drafts=()) -> np.ndarray:
    """logits [R, vocab] of R rows, row j predicting the token after output_ids + drafts[:j]
    (a verification's [last, d1..dk]; R = 1: one next token) -> the rows after logit_bias and
    the penalties (the module docstring's order), float64; `logits` itself when none is on,
    so the default path's arithmetic is untouched. The penalties count the output so far and
    the row's draft prefix, as plain decoding would have counted them by then."""
    if not params.processes_logits:
        return logits
    assert logits.ndim == 2 and len(drafts) >= len(logits) - 1, (logits.shape, len(drafts))
    z = np.array(logits, dtype=np.float64)  # [R, V] a copy
    if params.masks:
        mask_(z, params, output_ids, drafts)
    if params.logit_bias:
        ids, bias = (np.asarray(c) for c in zip(*params.logit_bias))
        z[:, ids] += bias
    if params.presence_penalty or params.frequency_penalty or params.repetition_penalty != 1:
        penalize_(z, params, prompt_ids, output_ids, drafts)
    return z


def mask_(z: np.ndarray, params: SamplingParams, output_ids, drafts) -> None:
    """z [R, V], in place: vLLM's masks, row j over output_ids + drafts[:j] (the module
    docstring's first steps); a token id past the vocabulary masks nothing."""
    rows, vocab = z.shape
    if params.allowed_token_ids:
        keep = np.zeros(vocab, dtype=bool)
        ids = np.asarray(params.allowed_token_ids)
        keep[ids[ids < vocab]] = True
        z[:, ~keep] = -np.inf
    if params.bad_words_ids:
        seen = [*output_ids[-max(map(len, params.bad_words_ids)):], *drafts[:rows - 1]]
        before = len(seen) - (rows - 1)  # the tokens row 0 follows: seen[:before]
        for j in range(rows):
            tail = seen[:before + j]
            for word in params.bad_words_ids:
                *head, last = word
                if last < vocab and (not head or tail[-len(head):] == head):
                    z[j, last] = -np.inf
    if params.min_tokens:
        ends = np.asarray([t for t in {*params.eos_token_ids, *params.stop_token_ids}
                           if t < vocab], dtype=np.int64)
        short = len(output_ids) + np.arange(rows) < params.min_tokens  # [R]
        z[np.ix_(short, ends)] = -np.inf


def penalize_(z: np.ndarray, params: SamplingParams, prompt_ids, output_ids, drafts) -> None:
    """z [R, V], in place: repetition, frequency and presence penalties, row j over
    output_ids + drafts[:j] (repetition: and the prompt). Only the columns of tokens seen are
    touched."""
    rows = len(z)
    tokens = np.asarray([*output_ids, *drafts[:rows - 1]], dtype=np.int64)  # [O + R - 1]
    prompt = np.asarray(prompt_ids if params.repetition_penalty != 1 else (), dtype=np.int64)
    cols = np.unique(np.concatenate([tokens, prompt]))  # [C] the token ids touched
    at = np.searchsorted(cols, tokens)
    n_out = len(output_ids)
    counts = np.tile(np.bincount(at[:n_out], minlength=len(cols)), (rows, 1))  # [R, C]
    for j in range(1, rows):  # row j also counts d1..dj
        counts[j:, at[n_out + j - 1]] += 1
    x = z[:, cols]  # [R, C]
    if params.repetition_penalty != 1:
        r = params.repetition_penalty
        seen = (counts > 0) | np.isin(cols, prompt)[None, :]
        x = np.where(seen, np.where(x > 0, x / r, x * r), x)
    x -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0)
    z[:, cols] = x


def probs_from_logits(logits: np.ndarray, temperature: float, top_k: int = 0,
                      top_p: float = 1.0, min_p: float = 0.0) -> np.ndarray:
    """logits: [..., vocab] -> probabilities [..., vocab] (float64). The steps, in order
    (runtime/sampling_torch.py's probs_from_logits takes the same ones, batched per row):

        temperature   z = logits / T                                         T > 0
        min-p         drop the tokens less likely than min_p times the most
                      likely one                                             min_p = 0: off
        top-k         keep the k largest z (ties with the k-th kept too)      k = 0: off
        softmax
        top-p         keep the smallest set of tokens, most likely first, whose
                      probability reaches p (the first token always stays)    p = 1: off

    A new per-request control is one more step here (or in process_logits, when it reads the
    tokens so far or changes the argmax) and one there, at the same place in the order;
    tests/test_sampling_torch.py holds the two to each other."""
    # (a NaN passes: its distribution is NaN, which the target's check_finite and the
    # planner's Draft.finite catch for the one stream; an assert would fail the batch)
    assert not temperature <= 0, temperature
    # every step in place on one float64 copy: a full-vocabulary temporary per operation
    # cost ~3x the arithmetic (fresh pages each time)
    x = logits.astype(np.float64)
    np.divide(x, temperature, out=x)
    mask_min_p_(x, min_p)
    mask_top_k_(x, top_k)
    softmax_(x)
    return keep_top_p(x, top_p)


def mask_min_p_(z: np.ndarray, min_p: float) -> None:
    """z: [..., vocab], in place: a token whose probability is below min_p times the largest
    becomes -inf (0: off). p(t) / max p = exp(z[t] - max z), so the test needs no softmax."""
    if min_p > 0:
        z[z < z.max(-1, keepdims=True) + np.log(min_p)] = -np.inf


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


def probs(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """probs_from_logits with the request's temperature, min-p, top-k and top-p."""
    return probs_from_logits(logits, params.temperature, params.top_k, params.top_p,
                             params.min_p)


def target_probs(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """probs of the target's row [vocab] (after process_logits and check_finite), checked:
    NonFiniteError where the request's temperature overflowed it (a row with every token
    ruled out, a grammar's dead end, is its guide's to report)."""
    p = probs(logits, params)
    if logits.max() > -np.inf:
        check_finite(p, "the target's probabilities under the request's temperature")
    return p


def next_token(logits: np.ndarray, params: SamplingParams, position: int) -> int:
    """logits: [vocab] (the target's, after process_logits and check_finite) -> the token at
    output position `position` (0: the first): the argmax when greedy, else the exponential
    race of the request's seed at that position (runtime/race.py), the same token whatever
    was drafted there."""
    if params.greedy:
        return int(np.argmax(logits))
    return race(target_probs(logits, params), params.seed, position)


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
