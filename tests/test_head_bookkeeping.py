"""The head proposers' bookkeeping under real acceptance. Random heads are almost always
rejected, so here oracle modules stand in for the drafter graphs: an oracle knows each
stream's true greedy continuation and drafts it (wrong on a fixed fraction of rows), and it
checks every row it is fed — the token, and where its hidden state came from: the target's
row at that position (module 0), module i-1's row at the same position (module i), or its
own previous row (the loop past the last module)."""

import zlib

import numpy as np
import pytest

from tests.engine_util import custom_stream, engine_with
from trt_spec.runtime.backends.base import StepOutput
from trt_spec.runtime.generator import Generator
from trt_spec.runtime.kv_cache import KVCache
from trt_spec.runtime.settings import SpeculationConfig
from trt_spec.runtime.proposers.base import DraftVocab
from trt_spec.runtime.proposers.eagle3 import Eagle3Proposer
from trt_spec.runtime.proposers.mtp import MtpProposer
from trt_spec.runtime.sampling import SamplingParams
from trt_spec.runtime.step_inputs import SlotTokens, build_step_inputs, commit_lengths
from trt_spec.runtime.scheduler import generate_ids

PROMPTS = [[5, 17, 99, 3, 17, 99], [42, 8, 77, 61, 23, 11, 90, 8, 77], [4, 4]]
GREEDY = SamplingParams(max_tokens=40, ignore_eos=True)
MISS = 0.25  # fraction of rows where an oracle drafts a wrong token


class Oracle:
    """Stands in for module i's graph. Its next_hidden_states rows are (i, position, token, 0,
    ...), so whoever reads them next can be checked."""

    def __init__(self, i: int, truth: dict, target_rows: dict, vocab: int):
        self.i, self.truth, self.target_rows, self.vocab = i, truth, target_rows, vocab
        self.checked = {"real token": 0, "target row": 0, "previous module": 0, "loop": 0}

    def step(self, cache: KVCache, requests: list[SlotTokens], want=()) -> StepOutput:
        build_step_inputs(cache, requests, cache.max_len)  # the real checks: slots, room
        logits, rows = [], []
        for r in requests:
            seq, first = self.truth[r.slot], int(cache.lengths[r.slot])
            last = first + len(r.tokens) - 1
            out = np.zeros((len(r.tokens), r.hidden.shape[1]), dtype=np.float32)
            for t, (token, h) in enumerate(zip(r.tokens, r.hidden)):
                self.check(r.slot, first + t, last, token, h, seq)
                out[t, :3] = (self.i, first + t, token)
            answer = seq[last + self.i + 2] if last + self.i + 2 < len(seq) else 0
            if zlib.crc32(f"{self.i},{r.slot},{last}".encode()) % 100 < MISS * 100:
                answer = (answer + 1) % self.vocab
            row = np.full((1, self.vocab), -10.0, dtype=np.float32)
            row[0, answer] = 10.0
            logits.append(row)
            rows.append(out)
        commit_lengths(cache, requests)
        return StepOutput(logits, {"next_hidden_states": rows})

    def check(self, slot, p, last, token, h, seq):
        encoded = not h[3:].any()
        loop = encoded and tuple(h[:2]) == (self.i, p - 1)
        if loop:  # one row past the anchor, reading a draft and its own previous row
            assert last == p, (self.i, slot, p, last)
            self.checked["loop"] += 1
            return
        if p <= last - self.i:  # catch-up rows read real tokens up to here, drafts after
            assert token == seq[p + self.i + 1], (self.i, slot, p, token, seq[p + self.i + 1])
            self.checked["real token"] += 1
        if self.i == 0:
            np.testing.assert_allclose(h, self.target_rows[slot][p], atol=1e-4)
            self.checked["target row"] += 1
        else:
            assert encoded and tuple(h[:2]) == (self.i - 1, p), (self.i, slot, p, h[:3])
            self.checked["previous module"] += 1


@pytest.fixture(scope="module")
def gen(tiny_heads_engine):
    return Generator(tiny_heads_engine, max_batch=3)


@pytest.fixture(scope="module")
def truth(gen):
    """Per prompt: prompt + plain greedy output, and the target's rows over it."""
    outputs = [s.output_ids for s in generate_ids(gen, PROMPTS, GREEDY, "none")]
    seqs = [p + o for p, o in zip(PROMPTS, outputs)]
    rows = {}
    for reads in ("hidden_states", "eagle3_features"):
        cache = KVCache(gen.config, 1, gen.cache.max_len)
        rows[reads] = []
        for seq in seqs:
            cache.lengths[0] = 0
            out = gen.target.step(cache, [SlotTokens(0, seq, [0])], (reads,))
            rows[reads].append(out.rows[reads][0])
    return seqs, rows


def check_run(gen, proposer, oracles, k, seqs, target_rows):
    # no gain rules: they cut k by measured step costs, so under load the loop past the
    # last module might never run
    config = SpeculationConfig(num_draft_tokens=k, min_acceptance=0, fallback=False)
    engine = engine_with(gen, proposer, config)
    streams = [custom_stream(p, GREEDY, k) for p in PROMPTS]
    for s, seq, rows in zip(streams, seqs, target_rows):
        engine.admit(s)
        for o in oracles:
            o.truth[s.slot], o.target_rows[s.slot] = seq, rows
    while not all(s.finished for s in streams):
        engine.step([s for s in streams if not s.finished])
    assert [s.prompt_ids + s.output_ids for s in streams] == seqs  # lossless
    accepted = sum(s.stats.accepted for s in streams) / sum(s.stats.proposed for s in streams)
    assert accepted > 0.4, accepted  # the oracles' drafts do get accepted
    positions = set()  # draft positions accepted at least once: prefixes of several lengths
    for s in streams:
        positions |= {i for i, a in enumerate(s.stats.accepted_per_position) if a}
    assert len(positions) >= min(k, 3), positions
    for o in oracles[:k]:  # the modules that ran
        assert o.checked["real token"] > 0
        assert o.checked["target row" if o.i == 0 else "previous module"] > 0
    if k > len(oracles):
        assert oracles[-1].checked["loop"] > 0


@pytest.mark.parametrize("n_modules", [1, 2, 3])
@pytest.mark.parametrize("k", [1, 3, 5])
def test_mtp_and_eagle_rows(gen, truth, n_modules, k):
    seqs, rows = truth
    oracles = [Oracle(i, {}, {}, gen.config.vocab_size) for i in range(n_modules)]
    caches = [KVCache(gen.config, 3, gen.cache.max_len, num_layers=1) for _ in oracles]
    check_run(gen, MtpProposer(oracles, caches), oracles, k, seqs, rows["hidden_states"])


@pytest.mark.parametrize("k", [1, 4])
def test_eagle3_rows(gen, truth, k):
    """Eagle3's plumbing: the target's fused features through fc (here the identity) and
    draft ids mapped to target ids (here a full-size map with d2t = 0)."""
    seqs, rows = truth
    oracle = Oracle(0, {}, {}, gen.config.vocab_size)
    cache = KVCache(gen.config, 3, gen.cache.max_len, num_layers=1)
    proposer = Eagle3Proposer(oracle, cache, lambda x: x,
                              DraftVocab(np.zeros(gen.config.vocab_size, dtype=np.int64),
                                         gen.config.vocab_size))
    check_run(gen, proposer, [oracle], k, seqs, rows["eagle3_features"])


def test_rows_buffer_writes_in_place_and_drops_without_copying_what_it_keeps():
    """MtpProposer's store of the target's rows: a write replaces from its start on, dropping
    the oldest moves an offset, and growth keeps every row (positions stay absolute)."""
    from trt_spec.runtime.proposers.mtp import Rows

    def row(p):
        return np.full((1, 3), float(p), np.float32)

    r = Rows(5, np.concatenate([row(5), row(6)]))
    assert (r.base, r.end) == (5, 7)
    r.write(7, row(7))
    r.write(7, np.concatenate([row(70), row(8)]))  # a rewrite from 7 on (a rejected row)
    assert r.rows(5, 9)[:, 0].tolist() == [5, 6, 70, 8]
    r.drop_before(7)
    assert (r.base, r.end) == (7, 9) and r.rows(7, 9)[:, 0].tolist() == [70, 8]
    for p in range(9, 300):  # many times the first capacity: the buffer grows, rows stay
        r.write(p, row(p))
        if p % 50 == 0:
            r.drop_before(p - 10)
    assert r.base == 240 and r.rows(240, 300)[:, 0].tolist() == list(map(float, range(240, 300)))
    assert len(r.buf) <= 256  # what was dropped is not carried along
    with pytest.raises(AssertionError):
        r.rows(230, 245)  # dropped
