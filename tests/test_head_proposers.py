"""MTP, Eagle and Eagle3 proposers end to end over exported graphs (random heads): lossless
greedy output, batched, every k; sampled drafts come with the q they were drawn from."""

import numpy as np
import pytest

from tests.engine_util import custom_stream, engine_with
from trt_spec.runtime.generator import Generator
from trt_spec.runtime.manifest import load_manifest
from trt_spec.runtime.methods import Speculation
from trt_spec.runtime.proposers.mtp import MtpProposer
from trt_spec.runtime.sampling import SamplingParams
from trt_spec.runtime.settings import SpeculationConfig
from trt_spec.runtime.scheduler import generate_ids

PROMPTS = [[5, 17, 99, 3, 17, 99], [42, 8, 77, 61, 23, 11, 90, 8, 77], [4, 4]]
GREEDY = SamplingParams(max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def plain_outputs(tiny_heads_engine):
    gen = Generator(tiny_heads_engine, max_batch=3)
    return [s.output_ids for s in generate_ids(gen, PROMPTS, GREEDY)]


def run(gen: Generator, method: str, k: int, prompts, params, modules: int | None = None):
    """Random heads draft every step when gen's policy has no fallback (min_acceptance 0:
    no cooldown). modules: an MTP checkpoint with fewer modules (the first `modules`)."""
    if modules is None:
        return generate_ids(gen, prompts, params, method, k)
    full = gen.proposer(method)
    engine = engine_with(gen, MtpProposer(full.modules[:modules], full.caches[:modules]),
                         SpeculationConfig(num_draft_tokens=k,
                                           fallback=gen.speculation.fallback))
    streams = [custom_stream(p, params, k) for p in prompts]
    for s in streams:
        engine.admit(s)
    while not all(s.finished for s in streams):
        engine.step([s for s in streams if not s.finished])
    return streams


@pytest.mark.parametrize("method,modules", [("mtp", 1), ("mtp", 2), ("mtp", 3), ("eagle", None),
                                            ("eagle3", None)])
@pytest.mark.parametrize("k", [1, 3, 5])
@pytest.mark.parametrize("batch", [1, 3])
def test_greedy_heads_equal_plain(tiny_heads_engine, plain_outputs, method, modules, k, batch):
    # every step drafts (no fallback, though random heads do not pay): the proposer is tested
    gen = Generator(tiny_heads_engine, max_batch=batch, fallback=False)
    streams = run(gen, method, k, PROMPTS[:batch], GREEDY, modules)
    assert [s.output_ids for s in streams] == plain_outputs[:batch]
    for s in streams:  # every step but prefill and the last one drafted: speculation ran
        assert len(s.stats.proposed_per_position) <= k
        assert s.stats.proposed_per_position[0] >= s.stats.target_forwards - 2


def test_manifest_lists_the_drafters(tiny_heads_engine):
    manifest = load_manifest(tiny_heads_engine)
    drafters = manifest.data["drafters"]
    assert drafters["mtp"]["graphs"] == ["mtp_0", "mtp_1", "mtp_2"]
    assert drafters["mtp"]["num_modules"] == 3
    assert drafters["eagle"]["graphs"] == ["eagle"]
    e3 = drafters["eagle3"]
    assert e3["feature_layers"] == [1, 2, 3] and e3["draft_vocab_size"] == 48
    assert manifest.config.eagle3_layers == (1, 2, 3)  # the target follows the head
    assert "eagle3_d2t.npy" in manifest.data["files"]  # checksummed like the graphs


def test_drafts_hit_and_miss(tiny_heads_engine):
    """Some of the time the random heads draft what the target says, so the runs above pass
    through accepted prefixes of several lengths, not only rejections."""
    gen = Generator(tiny_heads_engine, max_batch=3, fallback=False)  # as the runs above
    accepted = {}
    for method in ("mtp", "eagle", "eagle3"):
        streams = generate_ids(gen, PROMPTS, SamplingParams(max_tokens=48, ignore_eos=True),
                                   method, 3)
        accepted[method] = sum(s.stats.accepted for s in streams)
    assert sum(accepted.values()) > 0, accepted


@pytest.mark.parametrize("method", ["mtp", "eagle", "eagle3"])
def test_sampled_drafts_come_with_q(tiny_heads_engine, method):
    """q is a distribution over the target vocabulary, the draft has q > 0, and Eagle3's q is
    zero outside its draft vocabulary."""
    gen = Generator(tiny_heads_engine, max_batch=2)
    engine, proposer = gen.engine, gen.proposer(method)
    params = SamplingParams(max_tokens=8, temperature=0.8, top_p=0.9, seed=1, ignore_eos=True)
    streams = [gen.stream(p, params, Speculation(method, 3)) for p in PROMPTS[:2]]
    for s in streams:
        engine.admit(s)
    engine.step(streams)  # prefill
    drafts = proposer.propose(streams, [3, 3])
    for tokens, q in zip(drafts.tokens, drafts.probs):
        assert q.shape == (3, gen.config.vocab_size)
        np.testing.assert_allclose(q.sum(-1), 1, atol=1e-5)
        assert (q[np.arange(3), tokens] > 0).all()
        if method == "eagle3":
            assert (q[:, np.setdiff1d(np.arange(gen.config.vocab_size),
                                      proposer.vocab.draft_to_target)] == 0).all()


def test_sampled_heads_are_seeded(tiny_heads_engine):
    params = SamplingParams(max_tokens=20, temperature=1.0, seed=7, ignore_eos=True)
    runs = []
    for _ in range(2):
        gen = Generator(tiny_heads_engine, method="eagle3", max_batch=3)
        runs.append([s.output_ids for s in generate_ids(gen, PROMPTS, params)])
    assert runs[0] == runs[1]


def test_eagle3_q_matches_its_samples(tiny_heads_engine):
    """The draft token is drawn from exactly the q it reports (over seeds: the race of a
    seed at a position is one draw)."""
    gen = Generator(tiny_heads_engine, method="eagle3")
    proposer = gen.proposer("eagle3")
    logits = np.random.default_rng(0).normal(size=len(proposer.vocab)) * 2
    s = gen.stream([1], SamplingParams(temperature=1.0, seed=3))
    counts = np.zeros(gen.config.vocab_size)
    n = 20000
    for seed in range(n):
        s.params = SamplingParams(temperature=1.0, seed=seed)
        token, q = proposer.pick(s, logits)
        counts[token] += 1
    np.testing.assert_allclose(counts / n, q, atol=0.015)


@pytest.mark.parametrize("method", ["mtp", "eagle", "eagle3"])
@pytest.mark.parametrize("k", [1, 3])
def test_a_head_that_would_catch_up_on_many_rows_restarts_on_the_last_ones(
        tiny_heads_engine, plain_outputs, method, k):
    """With a re-prime window of 2 rows, every catch-up longer than that (the prompt, each
    step that accepted drafts) restarts the head's caches on its last 2 rows at shifted
    positions: output stays plain greedy's, batched, and the caches did restart."""
    gen = Generator(tiny_heads_engine, max_batch=3, fallback=False)
    full = gen.proposer(method)
    head = type(full).__new__(type(full))
    head.__dict__.update(full.__dict__)  # the same graphs and caches, state of its own
    head.slots, head.reprime = {}, 2
    engine = engine_with(gen, head, SpeculationConfig(num_draft_tokens=k, fallback=False))
    streams = [custom_stream(p, GREEDY, k) for p in PROMPTS]
    for s in streams:
        engine.admit(s)
    offsets = set()
    while not all(s.finished for s in streams):
        engine.step([s for s in streams if not s.finished])
        offsets |= {st.offset for st in head.slots.values()}
    assert [s.output_ids for s in streams] == plain_outputs
    assert max(offsets) > 0  # restarted
    for s in streams:
        assert s.stats.proposed_per_position[0] >= s.stats.target_forwards - 2


@pytest.mark.parametrize("k", [1, 3])
def test_a_draft_model_that_would_catch_up_on_many_tokens_restarts_on_the_last_ones(
        tiny_spec_engine, k):
    """The vanilla draft with a re-prime window of 2 tokens: its cache restarts (shifted
    positions) on every longer catch-up; output stays plain greedy's, and a slot reused by a
    shorter request starts again."""
    gen = Generator(tiny_spec_engine, max_batch=3, fallback=False)
    full = gen.proposer("vanilla")
    draft = type(full)(full.draft, full.cache, full.vocab, reprime=2)
    engine = engine_with(gen, draft, SpeculationConfig(num_draft_tokens=k, fallback=False))
    for prompts in (PROMPTS, [p[:2] for p in PROMPTS]):  # then shorter requests, same slots
        streams = [custom_stream(p, GREEDY, k) for p in prompts]
        for s in streams:
            engine.admit(s, reuse=False)
        offsets = set()
        while not all(s.finished for s in streams):
            engine.step([s for s in streams if not s.finished])
            offsets |= set(draft.offsets.values())
        plain = [s.output_ids for s in generate_ids(gen, prompts, GREEDY)]
        assert [s.output_ids for s in streams] == plain
        assert max(offsets) > 0
