"""Model drafters under a grammar (runtime/proposers/base.py `held`): they draft within what
the grammar allows, its state advanced along the draft, so no draft token is one the
structure refuses; greedy output is plain decoding's and sampled output follows the exact
distribution of plain decoding under the grammar (q renormalised over the allowed tokens)."""

import pytest

from tests.test_sampling_controls import chi2_pvalue, reference
from trt_spec.runtime.generator import Generator
from trt_spec.runtime.methods import Speculation
from trt_spec.runtime.sampling import SamplingParams
from trt_spec.runtime.scheduler import Scheduler, generate_ids
from trt_spec.runtime.settings import SpeculationConfig

MODEL_DRAFTERS = ("vanilla", "mtp", "eagle", "eagle3")
LETTER0 = 8  # the tiny tokenizer's "a" (after 5 specials and 3 role words)
RUNS = 400
TOKENS = 3


def letter(token: int) -> str:
    return chr(ord("a") + token - LETTER0)


@pytest.fixture(scope="module")
def setup(tiny_vocab_engine):
    """Three letters every head can draft (inside the folder's 48-token draft vocabulary), and
    a regex over three positions that allows two of them at each and refuses the third."""
    gen = Generator(tiny_vocab_engine, max_len=32)
    vocab = gen.proposer("eagle3").vocab
    a, b, c = sorted(set(vocab.draft_to_target.tolist()) & set(range(LETTER0, LETTER0 + 26)))[:3]
    allowed = [(a, b), (a, c), (b, c)]
    regex = "".join(f"({letter(x)}|{letter(y)})" for x, y in allowed)
    return gen, (a, b, c), allowed, regex


def speculative(engine, method: str, steer: bool = True) -> Generator:
    return Generator(engine, method=method, max_batch=16, max_len=32, grammar_drafts=steer,
                     speculation=SpeculationConfig(num_draft_tokens=3, fallback=False))


def test_steered_drafts_are_always_allowed_and_greedy_equals_plain(tiny_vocab_engine, setup):
    gen, (a, b, c), allowed, regex = setup
    prompt = [a, b, c, a, b, c, a]
    # the bias makes each head's favourite one the grammar refuses somewhere
    params = SamplingParams(max_tokens=6, regex=regex, logit_bias={a: 5.0, b: 5.0, c: 5.0})
    plain = generate_ids(gen, [prompt], params)[0].output_ids
    cut = 0
    for method in MODEL_DRAFTERS:
        for steer in (True, False):
            g = speculative(tiny_vocab_engine, method, steer)
            s = generate_ids(g, [prompt], params, method, 3)[0]
            assert s.output_ids == plain, (method, steer)
            steps = {t.step: t.drafted for t in s.sources if t.drafter == method}
            assert steps, (method, steer)
            # a steered draft is all allowed, so it is cut only where the grammar ends: k = 3,
            # or the letters left and EOS (TOKENS in all, before it the tokens emitted)
            room = {step: min(3, TOKENS + 1 - sum(t.step < step for t in s.sources))
                    for step in steps}
            if steer:
                assert steps == room, (method, steps, room)
            else:
                cut += steps != room
    assert cut  # unsteered, the biased heads draft a refused letter somewhere


@pytest.mark.parametrize("method", MODEL_DRAFTERS)
def test_sampled_output_under_the_grammar_follows_plain_decoding(tiny_vocab_engine, setup,
                                                                 method):
    gen, (a, b, c), allowed, regex = setup
    prompt = [a, b, c, a, b, c, a, b]
    params = dict(max_tokens=TOKENS, temperature=1.0, regex=regex,
                  logit_bias={a: 3.0, b: 3.0, c: 3.0})
    dist = reference(gen, SamplingParams(temperature=1.0, logit_bias=params["logit_bias"]),
                     TOKENS, prompt, allowed)
    steered = speculative(tiny_vocab_engine, method)
    streams = Scheduler(steered).run([steered.stream(prompt, SamplingParams(seed=i, **params),
                                                     Speculation(method, 3)) for i in range(RUNS)])
    counts = {}
    for s in streams:
        counts[tuple(s.output_ids)] = counts.get(tuple(s.output_ids), 0) + 1
    assert sum(s.stats.accepted for s in streams) > RUNS // 4, method
    assert chi2_pvalue(counts, dist, RUNS) > 1e-6, method


def test_a_draft_that_ends_in_eos_leaves_the_grammar_as_it_was(setup):
    """Masks for a draft that completes the structure and then drafts EOS: the matcher is
    left where it was (EOS is never consumed and rolled back: llguidance 1.9.1 then refuses
    the same end again), and the stream can still consume the draft to the end."""
    gen, (a, b, c), allowed, regex = setup
    eos = gen.grammars.eos_ids[0]
    guide = gen.grammars.guide(SamplingParams(regex=regex))
    draft = [a, a, b, eos]
    assert guide.valid(draft) == 4
    rows = guide.masks(draft)
    assert rows.shape[0] == 5
    assert guide.allowed(draft[:3]) is not None and guide.allowed(draft) is None
    assert all(guide.consume(t) for t in draft[:3]) and guide.done
    assert guide.consume(eos)
