"""The engine end to end on tiny models: lossless greedy output, p = q accepts everything,
seeded sampling, dynamic disable, streams switching method, one target forward per step."""

import numpy as np
import pytest

from trt_spec.runtime.engine import Engine
from trt_spec.runtime.stream import Stream
from trt_spec.runtime.generator import Generator
from trt_spec.runtime.methods import Speculation
from trt_spec.runtime.speculation.policy import SpeculationPolicy
from trt_spec.runtime.settings import SpeculationConfig
from trt_spec.runtime.proposers.base import Drafts, Proposer
from trt_spec.runtime.proposers.ngram import NgramProposer, ngram_match
from trt_spec.runtime.proposers.suffix import SuffixCache
from trt_spec.runtime.sampling import SamplingParams
from trt_spec.runtime.scheduler import generate_ids

PROMPTS = [[5, 17, 99, 3, 17, 99], [42, 8, 77, 61, 23, 11, 90, 8, 77], [4, 4]]
GREEDY = SamplingParams(max_tokens=24, ignore_eos=True)


def plain(engine_dir, prompts, params=GREEDY):
    gen = Generator(engine_dir, max_batch=len(prompts))
    return [s.output_ids for s in generate_ids(gen, prompts, params)]


@pytest.mark.parametrize("method", ["vanilla", "ngram"])
@pytest.mark.parametrize("k", [1, 2, 4, 8])
@pytest.mark.parametrize("batch", [1, 3])
def test_greedy_speculative_equals_plain(tiny_spec_engine, method, k, batch):
    prompts = PROMPTS[:batch]
    gen = Generator(tiny_spec_engine, method=method, max_batch=batch,
                    speculation=SpeculationConfig(num_draft_tokens=k))
    streams = generate_ids(gen, prompts, GREEDY)
    assert [s.output_ids for s in streams] == plain(tiny_spec_engine, prompts)
    for s in streams:
        m = s.metrics()
        assert m.tau == pytest.approx(len(s.output_ids) / s.stats.target_forwards)
        assert 0 <= m.accepted_tokens <= m.proposed_tokens


@pytest.mark.parametrize("k", [2, 4])
def test_truncated_self_draft_is_lossless(tiny_truncated_engine, k):
    gen = Generator(tiny_truncated_engine, method="vanilla", max_batch=3,
                    speculation=SpeculationConfig(num_draft_tokens=k))
    assert [s.output_ids for s in generate_ids(gen, PROMPTS, GREEDY)] == \
        plain(tiny_truncated_engine, PROMPTS)


def test_partial_acceptance_is_exercised(tiny_spec_engine):
    """The noisy-copy draft is neither always accepted nor always rejected."""
    gen = Generator(tiny_spec_engine, method="vanilla", max_batch=3)
    streams = generate_ids(gen, PROMPTS, GREEDY)
    rate = sum(s.stats.accepted for s in streams) / sum(s.stats.proposed for s in streams)
    assert 0.1 < rate < 0.9, rate


def test_draft_equal_to_target_accepts_everything(tiny_self_engine):
    """p = q: every draft is accepted, so each target forward emits k + 1 tokens (greedy and
    sampled alike), and the output is still the plain one."""
    k = 4
    # (no fallback: a draft model as large as the target does not pay, and every step drafts)
    gen = Generator(tiny_self_engine, method="vanilla", max_batch=3,
                    speculation=SpeculationConfig(num_draft_tokens=k, fallback=False))
    params = SamplingParams(max_tokens=21, ignore_eos=True)  # 1 (prefill) + 4 x 5
    streams = generate_ids(gen, PROMPTS, params)
    assert [s.output_ids for s in streams] == plain(tiny_self_engine, PROMPTS, params)
    for s in streams:
        assert s.stats.accepted == s.stats.proposed == 16 and s.stats.target_forwards == 5
        assert s.metrics().acceptance_per_position == (1.0,) * k
    sampled = SamplingParams(max_tokens=21, temperature=1.0, top_p=0.9, seed=3, ignore_eos=True)
    for s in generate_ids(gen, PROMPTS, sampled):
        assert s.stats.accepted == s.stats.proposed == 16


@pytest.mark.parametrize("method", ["vanilla", "ngram"])
def test_seeded_sampling_is_reproducible(tiny_spec_engine, method):
    gen = Generator(tiny_spec_engine, method=method, max_batch=3)
    params = SamplingParams(max_tokens=20, temperature=0.9, top_k=30, seed=5, ignore_eos=True)
    a = [s.output_ids for s in generate_ids(gen, PROMPTS, params)]
    b = [s.output_ids for s in generate_ids(gen, PROMPTS, params)]
    assert a == b and all(len(x) == 20 for x in a)


def test_stop_inside_accepted_drafts(tiny_self_engine):
    """EOS / max_tokens that fall among accepted drafts cut the output exactly there."""
    gen = Generator(tiny_self_engine, method="vanilla",
                    speculation=SpeculationConfig(num_draft_tokens=8))
    ref = plain(tiny_self_engine, PROMPTS[:1], SamplingParams(max_tokens=30, ignore_eos=True))[0]
    s = generate_ids(gen, PROMPTS[:1], SamplingParams(max_tokens=7, ignore_eos=True))[0]
    assert s.output_ids == ref[:7] and s.finish_reason == "length"
    stop = ref[5]
    s = generate_ids(gen, PROMPTS[:1], SamplingParams(max_tokens=30, stop_token_ids=(stop,),
                                                     ignore_eos=True))[0]
    assert s.output_ids == ref[:ref.index(stop) + 1] and s.finish_reason == "stop"


def test_method_none_drafts_nothing(tiny_spec_engine):
    gen = Generator(tiny_spec_engine, method="vanilla", max_batch=3)
    streams = generate_ids(gen, PROMPTS, GREEDY, method="none")
    assert all(s.stats.proposed == 0 and s.stats.target_forwards == len(s.output_ids) for s in streams)
    assert [s.output_ids for s in streams] == plain(tiny_spec_engine, PROMPTS)


def test_batch_over_threshold_turns_speculation_off(tiny_self_engine):
    """spec_max_batch=2: with 3 streams decoding nothing is drafted; once one has finished,
    the other two speculate again."""
    prompts = PROMPTS
    gen = Generator(tiny_self_engine, method="vanilla", max_batch=3,
                    speculation=SpeculationConfig(num_draft_tokens=2, spec_max_batch=2))
    streams = [gen.stream(p, SamplingParams(max_tokens=n, ignore_eos=True))
               for p, n in zip(prompts, (4, 24, 24))]
    for s in streams:
        gen.engine.admit(s)
    steps = []
    while not all(s.finished for s in streams):
        steps.append(gen.engine.step(streams))
    decoding = [m for m in steps if m.decode_streams]
    assert all(m.proposed_tokens == 0 for m in decoding if m.decode_streams > 2)
    assert any(m.proposed_tokens > 0 for m in decoding if m.decode_streams <= 2)
    assert [s.output_ids for s in streams][1:] == plain(tiny_self_engine, prompts)[1:]


class ConstantProposer(Proposer):
    """Always drafts token 0 (the tokenizer's <unk>, never the tiny model's argmax here)."""

    name = "constant"

    def propose(self, streams, ks, gate=None):
        return Drafts([np.zeros(k, dtype=np.int64) for k in ks], [None] * len(streams))


def test_low_acceptance_turns_speculation_off_then_on(tiny_spec_engine):
    """Drafts that are never accepted: after `window` speculative steps below min_acceptance
    the stream decodes plainly for `cooldown` steps, then tries again."""
    config = SpeculationConfig(num_draft_tokens=2, min_acceptance=0.5, window=2, cooldown=3,
                               fallback=False)  # the acceptance rule alone
    gen = Generator(tiny_spec_engine)
    constant = ConstantProposer()
    engine = Engine(gen.target, gen.cache, gen.stops, config,
                    lambda method: None if method == "none" else constant)
    s = Stream(PROMPTS[1], SamplingParams(max_tokens=24, ignore_eos=True), "constant", 2)
    engine.admit(s)
    proposed = []
    while not s.finished:
        proposed.append(engine.step([s]).proposed_tokens)
    pattern = "".join("s" if p else "-" for p in proposed[1:])  # after the prefill step
    assert pattern.startswith("ss---ss---ss---"), pattern
    assert s.stats.accepted == 0
    assert s.output_ids == plain(tiny_spec_engine, PROMPTS[1:2])[0]


def test_policy_caps_k_by_budget_and_cache():
    class S:
        id, num_draft_tokens = 1, 8
        params = SamplingParams(max_tokens=10)
        prompt_ids, output_ids = [1] * 5, [2] * 7

    policy = SpeculationPolicy(SpeculationConfig(num_draft_tokens=8), max_len=100)
    assert policy.plan([S()]) == [2]  # 3 tokens still allowed: 2 drafts + 1
    assert SpeculationPolicy(SpeculationConfig(), max_len=14).plan([S()]) == [2]
    assert SpeculationPolicy(SpeculationConfig(), max_len=13).plan([S()]) == [1]


def test_streams_switch_method_between_steps(tiny_spec_engine):
    """Plain steps, then speculative ones, then plain again, on the same streams and caches:
    the output is the plain one."""
    gen = Generator(tiny_spec_engine, method="vanilla", max_batch=3)
    streams = [gen.stream(p, GREEDY) for p in PROMPTS]
    for s in streams:
        gen.engine.admit(s)
    for i in range(40):
        for s in streams:
            s.method, s.num_draft_tokens = ("vanilla", 3) if (i // 3) % 2 else ("none", 0)
        gen.engine.step([s for s in streams if not s.finished])
    assert all(s.finished for s in streams)
    assert [s.output_ids for s in streams] == plain(tiny_spec_engine, PROMPTS)
    assert sum(s.stats.proposed for s in streams) > 0


def counted(logits, calls: list):
    """decode_one's answer, a forward counted where it ran one (None: the general step runs)."""
    if logits is not None:
        calls.append(1)
    return logits


def test_one_target_forward_per_step_whatever_the_methods(tiny_spec_engine):
    """Streams of none, ngram (k 2) and vanilla (k 4) side by side, one admitted late: each
    step runs at most one prefill and one decode/verify forward of the target (besides the
    timing forwards of the cost probe, the first time a batch size decodes), and every
    stream's output is the plain one. (The gain rules off: on random models they would
    rightly cut most drafts, and this is about the drafts sharing one forward.)"""
    gen = Generator(tiny_spec_engine, max_batch=4, fallback=False)
    calls = []
    step, one = gen.target.step, gen.target.decode_one  # (one: a lone plain stream's step)
    gen.target.step = lambda *a, **kw: calls.append(1) or step(*a, **kw)
    gen.target.decode_one = lambda *a, **kw: counted(one(*a, **kw), calls)
    asks = [("none", None), ("ngram", 2), ("vanilla", "auto:4"), ("vanilla", 1)]
    streams = [gen.stream(p, GREEDY, Speculation(*a))
               for p, a in zip(PROMPTS + [[7, 7, 9]], asks)]
    for s in streams[:3]:
        gen.engine.admit(s)
    i, probes = 0, []
    while not all(s.finished for s in streams):
        if i == 2:
            gen.engine.admit(streams[3])
        before = len(calls)
        m = gen.engine.step([s for s in streams if s.slot is not None and not s.finished])
        assert len(calls) - before == m.target_forwards + m.probe_forwards
        assert m.target_forwards <= 2
        probes.append((m.decode_streams, m.probe_forwards))
        assert m.target_forwards == (m.prefill_streams > 0) + (m.decode_streams > 0)
        i += 1
    assert [s.output_ids for s in streams] == plain(tiny_spec_engine, PROMPTS + [[7, 7, 9]])
    assert all(s.stats.proposed > 0 for s in streams[1:])
    probed = [b for b, n in probes if n]  # each batch size at most once
    assert probed and len(probed) == len(set(probed)), probes


def test_ngram_match():
    seq = np.array([1, 2, 3, 9, 1, 2, 3, 7, 8, 1, 2, 3])
    assert ngram_match(seq, 2, 1, 3).tolist() == [7, 8]  # the most recent match wins
    assert ngram_match(seq, 5, 1, 3).tolist() == [7, 8, 1, 2, 3]
    assert ngram_match(np.array([5, 6, 7]), 3, 1, 3).tolist() == []
    assert ngram_match(np.array([4, 5, 4]), 3, 1, 3).tolist() == [5, 4]
    with pytest.raises(ValueError, match="1 <= min_n <= max_n"):
        NgramProposer(3, 2)


def test_ngram_index_finds_what_the_scan_finds_as_tokens_arrive():
    """The proposer's incremental index against the reference scan of the whole history, on
    random sequences over small vocabularies (many repeats), grown a few tokens at a time."""
    from trt_spec.runtime.proposers.ngram_index import NgramIndex

    rng = np.random.default_rng(0)
    for vocab, (lo, hi) in ((3, (1, 4)), (6, (2, 3)), (20, (1, 1))):
        index, seq = NgramIndex(lo, hi), []
        while len(seq) < 300:
            new = rng.integers(0, vocab, rng.integers(1, 5)).tolist()
            seq += new
            index.extend(new)
            for k in (1, 3, 7):
                want = ngram_match(np.array(seq), k, lo, hi).tolist()
                assert index.match(seq, k) == want, (vocab, len(seq), k)


def test_suffix_cache_index_forgets_evicted_requests_only():
    """A match whose most recent occurrence left with its request falls back to no match;
    one that still occurs in a kept request finds it there."""
    cache = SuffixCache(max_tokens=10)
    cache.add([1, 2, 3, 4])
    cache.add([5, 2, 3, 9])
    assert cache.match([2, 3], 2, 2, 4).tolist() == [9]  # the most recent
    cache.add([6, 7, 8])  # 11 tokens: [1, 2, 3, 4] leaves
    assert cache.match([2, 3], 2, 2, 4).tolist() == [9]
    cache.add([0, 0, 0, 0])  # [5, 2, 3, 9] leaves too
    assert cache.match([2, 3], 2, 2, 4).tolist() == []
    assert cache.match([6, 7], 5, 2, 4).tolist() == [8]  # a run stops at its request's end
    assert len(cache) == 2 and len(cache._index.tokens) == 9  # 7 tokens and 2 ends kept


def test_unknown_method_and_missing_draft(tiny_engine):
    with pytest.raises(ValueError, match="method 'medusa' is not known"):
        Generator(tiny_engine, method="medusa")
    with pytest.raises(ValueError, match="has no vanilla drafter"):
        Generator(tiny_engine, method="vanilla")


def test_each_method_has_one_proposer(tiny_spec_engine):
    gen = Generator(tiny_spec_engine, method="ngram")
    assert isinstance(gen.engine, Engine)
    assert isinstance(gen.proposer("ngram"), NgramProposer)
    assert gen.proposer("ngram") is gen.proposer("ngram") and gen.proposer("none") is None
