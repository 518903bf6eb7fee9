"""One request's failure ends that request alone, under every method; and the sampling
controls that can only overflow are refused up front (runtime/sampling.py's bounds).

A victim (greedy) runs beside a request made to fail, in the same steps of one scheduler; the
victim's tokens must be the ones it makes alone, and the other must end with "error" and a
message that says why. The bounds refuse the bad values, so the failures are injected around
them: a frozen SamplingParams changed with object.__setattr__, the target's output for one
slot overwritten with NaN, a proposer's q made NaN."""

import math

import numpy as np
import pytest

from trt_spec.runtime.generator import Generator
from trt_spec.runtime.methods import Speculation
from trt_spec.runtime.sampling import (MAX_SCALE, NonFiniteError, SamplingParams,
                                       check_finite, probs_from_logits, process_logits,
                                       target_probs)
from trt_spec.runtime.scheduler import Scheduler, generate_ids
from trt_spec.runtime.speculation.draft_length import DraftLength
from trt_spec.runtime.validation import FieldError

VICTIM = [5, 17, 99, 3, 17, 99, 42, 8]
BAD = [30, 31, 30, 31, 30, 12, 64, 90, 33, 7, 101, 44]  # many distinct tokens: some logit > 0
TOKENS = 12
SET = object.__setattr__  # past SamplingParams' checks, as a bug or a bypass would be


def greedy(n=TOKENS):
    return SamplingParams(max_tokens=n, ignore_eos=True)


@pytest.fixture(scope="module")
def gen(tiny_vocab_engine):
    """One generator with every method (vanilla, MTP, Eagle, Eagle3 and the lookups);
    fallback off so that every speculative stream drafts."""
    return Generator(tiny_vocab_engine, max_batch=3, num_draft_tokens=3, fallback=False)


@pytest.fixture(scope="module")
def alone(gen):
    """The victim's greedy tokens run alone, by method."""
    out = {}
    for m in gen.methods:
        sched = Scheduler(gen)
        r = sched.submit(VICTIM, greedy(), Speculation(m))
        while sched.has_work():
            sched.step()
        out[m] = r.stream.output_ids
    return out


METHODS = ["none", "vanilla", "mtp", "eagle", "eagle3", "ngram", "suffix", "hybrid", "auto"]


def test_the_engine_runs_every_method(gen):
    assert set(gen.methods) == set(METHODS)


# --- the failures, each armed at the start (prefill) or after two tokens (decode) ---------

def nan_temperature(gen, bad, monkeypatch):
    SET(bad.stream.params, "temperature", math.nan)


def tiny_repetition_penalty(gen, bad, monkeypatch):
    """vLLM's penalty divides a positive logit by it: 1e-310 makes it +inf (the issue's)."""
    SET(bad.stream.params, "repetition_penalty", 1e-310)


def nan_logits(gen, bad, monkeypatch):
    """The target's rows of the bad stream's slot (prefill or verify) become NaN."""
    target, step = gen.engine.target, gen.engine.target.step

    def poisoned(cache, requests, *args, **kwargs):
        out = step(cache, requests, *args, **kwargs)
        for i, r in enumerate(requests):
            if bad.stream.slot is not None and r.slot == bad.stream.slot:
                out.logits[i] = np.full_like(out.logits[i], np.nan)
        return out

    monkeypatch.setattr(target, "step", poisoned)


FAILURES = {"temperature": nan_temperature, "repetition_penalty": tiny_repetition_penalty,
            "logits": nan_logits}


def run_beside(gen, method, params, arm, when, monkeypatch):
    """The victim and a request with `params` in the same steps; `arm` makes the latter fail
    at its prefill, or once it has two tokens (when="decode"). -> (victim, bad, outputs)."""
    sched = Scheduler(gen)
    outputs = []
    victim = sched.submit(VICTIM, greedy(), Speculation(method), on_output=outputs.append)
    bad = sched.submit(BAD, params, Speculation(method), on_output=outputs.append)
    armed = False
    if when == "prefill":
        arm(gen, bad, monkeypatch)
        armed = True
    while sched.has_work():
        sched.step()
        if not armed and len(bad.stream.output_ids) >= 2:
            assert not bad.done, "the bad request ended before its failure was armed"
            arm(gen, bad, monkeypatch)
            armed = True
    return sched, victim, bad, outputs


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("kind", sorted(FAILURES))
@pytest.mark.parametrize("when", ["prefill", "decode"])
def test_a_failing_request_ends_alone(gen, alone, method, kind, when, monkeypatch):
    """The victim's output is its output alone; the failing request ends with "error", a
    message naming the cause, its slot freed; every slot is free at the end."""
    params = SamplingParams(max_tokens=TOKENS, ignore_eos=True, temperature=1.0, seed=7)
    released = []
    release = gen.engine.release
    monkeypatch.setattr(gen.engine, "release", lambda s, keep=True: (
        released.append((s.id, keep)), release(s, keep)))
    sched, victim, bad, outputs = run_beside(gen, method, params, FAILURES[kind], when,
                                             monkeypatch)
    assert (bad.stream.id, False) in released  # its rows are not kept for a prefix hit
    assert victim.stream.output_ids == alone[method]
    assert victim.stream.finish_reason == "length"
    assert bad.stream.finish_reason == "error"
    assert bad.error.startswith("NonFiniteError: the target's ") and "are not finite" in \
        bad.error, bad.error
    assert bad.stream.slot is None and sched.slots_used == 0
    finals = [o for o in outputs if o.finished]
    assert sorted(o.finish_reason for o in finals) == ["error", "length"]
    if when == "decode":
        assert len(bad.stream.output_ids) >= 2  # what it made before stays its own


def test_a_greedy_request_with_nan_logits_ends_alone(gen, alone, monkeypatch):
    """Greedy too: the argmax of a NaN row is no token (np.argmax would return its index)."""
    sched, victim, bad, _ = run_beside(gen, "vanilla", greedy(), nan_logits, "decode",
                                       monkeypatch)
    assert victim.stream.output_ids == alone["vanilla"]
    assert bad.stream.finish_reason == "error" and "NonFiniteError" in bad.error


@pytest.mark.parametrize("method", [m for m in METHODS if m != "none"])
def test_a_drafters_nan_q_drops_the_draft(gen, alone, method, monkeypatch):
    """A proposer whose q (or confidence) is NaN for one stream: that stream does not draft
    that step, and both streams' greedy tokens are the ones they make alone."""
    proposer = gen.engine.proposers(method)
    propose = proposer.propose
    poisoned_slots = set()

    def nan_q(streams, ks, gate=None):
        out = propose(streams, ks, gate)
        for j, s in enumerate(streams):
            if s.prompt_ids == BAD and len(out.tokens[j]):
                out.probs[j] = np.full((len(out.tokens[j]), gen.config.vocab_size), np.nan)
                poisoned_slots.add(s.slot)
        return out

    monkeypatch.setattr(proposer, "propose", nan_q)
    sched = Scheduler(gen)
    victim = sched.submit(VICTIM, greedy(), Speculation(method))
    bad = sched.submit(BAD, greedy(), Speculation(method))
    while sched.has_work():
        sched.step()
    monkeypatch.undo()
    assert victim.stream.output_ids == alone[method]
    assert bad.stream.finish_reason == "length"
    assert bad.stream.output_ids == generate_ids(gen, [BAD], greedy(), "none")[0].output_ids
    assert poisoned_slots, "the proposer never drafted for the bad stream"
    assert bad.stream.stats.proposed == 0  # each of its drafts was dropped


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("part", ["masks", "valid", "forced"])
def test_a_grammar_that_raises_fails_its_request_alone(gen, alone, method, part, monkeypatch):
    """A request held to a regex whose grammar raises once it has two tokens (in its masks,
    in holding drafts to it, or in its forced tokens: work the step shares): it ends with
    that error, and the victim's greedy tokens are the ones it makes alone."""
    sched = Scheduler(gen)
    victim = sched.submit(VICTIM, greedy(), Speculation(method))
    bad = sched.submit(BAD, SamplingParams(max_tokens=TOKENS, regex="(ab|xy)c(d|fg|h)+e"),
                       Speculation(method))

    def broken(*args, **kwargs):
        raise RuntimeError("the grammar broke")

    while sched.has_work():
        sched.step()
        if len(bad.stream.output_ids) >= 2 and bad.stream.guide is not None:
            monkeypatch.setattr(bad.stream.guide, part, broken)
    assert victim.stream.output_ids == alone[method]
    assert bad.stream.finish_reason == "error"
    assert bad.error == "RuntimeError: the grammar broke", bad.error
    assert sched.slots_used == 0


def test_a_nan_confidence_stops_the_gate():
    """The draft-length rule reads a NaN confidence as "draft no more" (it raised "cannot
    convert float NaN to integer" in Calibration.bin)."""
    gate = DraftLength().gate("eagle", [True, False], batch=2)
    assert gate.more(0, math.nan) is False
    assert gate.more(1, math.nan) is False
    assert gate.more(1, 0.9) is True


def test_run_raises_the_streams_error(gen):
    """generate / generate_ids (Scheduler.run) raise a stream's error, as before."""
    stream = gen.stream(BAD, greedy(), Speculation("none"))
    SET(stream.params, "repetition_penalty", 1e-310)
    with pytest.raises(NonFiniteError, match="logits under the request's sampling controls "
                                             "are not finite"):
        Scheduler(gen).run([stream])
    assert gen.cache.free_slots == gen.cache.slots


# --- the bounds -----------------------------------------------------------------------------

def test_a_temperature_below_the_epsilon_is_greedy():
    for t in (1e-310, 5e-324, 9.9e-6, 0.0):
        p = SamplingParams(temperature=t)
        assert p.temperature == 0.0 and p.greedy
    assert not SamplingParams(temperature=1e-5).greedy
    assert SamplingParams(temperature=1e-5).temperature == 1e-5


@pytest.mark.parametrize("kwargs, message", [
    ({"temperature": 1e21}, "temperature=1e+21: must be a finite number in 0..1e20 (below "
                            "1e-5: greedy)"),
    ({"temperature": -1e-310}, "temperature=-1e-310: must be a finite number in 0..1e20"),
    ({"top_p": 1e-21}, "top_p=1e-21: must be a finite number in 1e-20..1 (1 = off; a smaller "
                       "top_p would keep the most likely token alone, as 1e-20 does)"),
    ({"top_p": 0}, "top_p=0: must be a finite number in 1e-20..1"),
    ({"repetition_penalty": 1e-310}, "repetition_penalty=1e-310: must be a finite number in "
                                     "1e-20..1e20 (1 = off; past these a penalized logit "
                                     "overflows float32)"),
    ({"repetition_penalty": 1e21}, "repetition_penalty=1e+21: must be a finite number in "
                                   "1e-20..1e20"),
    # an int past float's range is refused, not an OverflowError from math.isfinite
    ({"temperature": 10**400}, "temperature=" + "1" + "0" * 76 + "...: must be a finite "
                               "number in 0..1e20"),
    ({"logit_bias": {3: -10**400}}, "logit_bias[3]=-" + "1" + "0" * 75 + "...: must be a "
                                    "finite number in -100..100"),
])
def test_values_that_overflow_are_refused(kwargs, message):
    with pytest.raises(FieldError) as e:
        SamplingParams(**kwargs)
    assert str(e.value).startswith(message), str(e.value)
    assert e.value.field == next(iter(kwargs))


EDGES = [  # every control at the ends of its range, with the sampling filters on
    dict(temperature=1e-5, repetition_penalty=1 / MAX_SCALE),
    dict(temperature=1e-5, repetition_penalty=MAX_SCALE),
    dict(temperature=MAX_SCALE, repetition_penalty=MAX_SCALE, top_p=1 / MAX_SCALE),
    dict(temperature=1e-5, top_p=1 / MAX_SCALE, min_p=1.0, top_k=3),
    dict(temperature=1e-5, min_p=5e-324, frequency_penalty=2.0, presence_penalty=2.0,
         logit_bias={0: 100.0, 1: -100.0}),
    dict(temperature=1e-5, frequency_penalty=-2.0, presence_penalty=-2.0,
         repetition_penalty=1 / MAX_SCALE, logit_bias={0: -100.0, 5: 100.0}),
]


@pytest.mark.parametrize("edge", EDGES)
def test_every_accepted_value_keeps_the_distribution_finite(edge):
    """Logits of magnitude up to 1e4, in float32 (the torch path's dtype) and float64 (the
    NumPy one's), with a grammar's -inf and the tokens seen so far: every step of
    process_logits and probs_from_logits stays finite under the bounds' extremes."""
    torch = pytest.importorskip("torch")
    from trt_spec.runtime import sampling_torch

    params = SamplingParams(**edge)
    rng = np.random.default_rng(0)
    vocab = 64
    logits = rng.uniform(-1e4, 1e4, (3, vocab)).astype(np.float32)
    logits[:, 7] = -np.inf  # ruled out by a grammar
    prompt, output, drafts = [1, 2, 3, 4], [5, 6, 5], [8, 9]
    z = check_finite(process_logits(logits, params, prompt, output, drafts), "z")
    for row in z:
        p = target_probs(row, params)
        assert np.isfinite(p).all() and abs(p.sum() - 1) < 1e-9 and p[7] == 0
    # the torch twin, in float32
    counts = np.zeros((1, 3, vocab), np.float32)
    for j in range(3):
        for t in output + drafts[:j]:
            counts[0, j, t] += 1
    bias = np.zeros((1, vocab), np.float32)
    for t, b in params.logit_bias:
        bias[0, t] = b
    seen = np.zeros((1, vocab), bool)
    seen[0, prompt] = True
    tz = sampling_torch.process_logits(
        torch.tensor(logits[None]), torch.tensor(bias), torch.tensor(counts),
        torch.tensor(seen), torch.tensor([params.repetition_penalty]),
        torch.tensor([params.frequency_penalty]), torch.tensor([params.presence_penalty]))
    one = lambda x, dt=torch.float32: torch.tensor([x], dtype=dt)  # noqa: E731
    tp = sampling_torch.probs_from_logits(tz, one(params.temperature), one(params.top_k,
                                          torch.int32), one(params.top_p), one(params.min_p))
    assert tz.dtype == torch.float32 and torch.isfinite(tp).all()
    assert torch.allclose(tp.sum(-1), torch.ones(1, 3)) and (tp[..., 7] == 0).all()


def test_check_finite_names_what_failed():
    ok = np.array([[0.0, -np.inf], [-np.inf, -np.inf]])  # a grammar's dead end passes
    assert check_finite(ok, "x") is ok
    target_probs(ok[1], SamplingParams(temperature=1.0))  # its guide reports it, not this
    for bad in (np.nan, np.inf):
        with pytest.raises(NonFiniteError, match=rf"the rows are not finite \(a row's maximum "
                                                 rf"is {bad}\)"):
            check_finite(np.array([[0.0, bad]]), "the rows")


def test_a_temperature_past_the_checks_fails_in_the_target_distribution():
    params = SamplingParams(temperature=1.0)
    SET(params, "temperature", 1e-310)  # below the epsilon, yet past the normalisation
    assert params.greedy  # the property reads the bound too
    SET(params, "temperature", math.nan)
    with pytest.raises(NonFiniteError, match="the target's probabilities under the "
                                             "request's temperature are not finite"):
        target_probs(np.array([1.0, 2.0]), params)
    # a drafter's distribution is not checked: its NaN makes the planner drop the draft
    assert np.isnan(probs_from_logits(np.array([1.0, 2.0]), math.nan)).all()


@pytest.mark.parametrize("temperature", [1e-40, 1e-6, 9.99e-6])
def test_spec_verify_takes_a_temperature_below_the_epsilon_as_greedy(temperature):
    """The SpecVerify op fed temperatures from elsewhere: below 1e-5 its NumPy reference and
    its torch form both verify greedily (a division by 1e-40 would make the row NaN), as the
    host's SamplingParams would."""
    torch = pytest.importorskip("torch")
    from trt_spec.plugins.spec_verify import spec_verify_reference, spec_verify_torch

    rng = np.random.default_rng(3)
    batch, k, vocab = 3, 4, 40
    logits = rng.normal(0, 2, (batch, k + 1, vocab)).astype(np.float32)
    drafts = logits[:, :k].argmax(-1)  # greedy: every draft accepted
    drafts[1, 2] = (drafts[1, 2] + 1) % vocab  # row 1: the third rejected
    case = dict(draft_tokens=drafts.astype(np.int64), draft_lens=np.full(batch, k, np.int32),
                target_logits=logits, seed=np.arange(batch, dtype=np.int64),
                position=np.zeros(batch, np.int64),
                temperature=np.full(batch, temperature, np.float32))
    want = np.array([k, 2, k])
    accepted, tokens = spec_verify_reference(**case)
    np.testing.assert_array_equal(accepted, want)
    t_accepted, t_tokens = spec_verify_torch(**{n: torch.tensor(x) for n, x in case.items()})
    np.testing.assert_array_equal(t_accepted.numpy(), want)
    np.testing.assert_array_equal(t_tokens.numpy(), tokens)
    assert tokens[1, 2] == logits[1, 2].argmax()
