"""The corpus table (runtime/runtime/corpus.py): built exactly as counting says, looked up
by the same keys, chained, stored in an engine folder, and drafting for the suffix lookups
without changing what greedy decoding writes."""

from __future__ import annotations

import json
import random
import shutil
from collections import Counter, defaultdict
from types import SimpleNamespace

import numpy as np
import pytest
from click.testing import CliRunner

from trt_spec.cli import main
from trt_spec.export.corpus import CORPUS_FILE, add_corpus, distilled_answers, remove_corpus
from trt_spec.runtime.generator import Generator
from trt_spec.runtime.manifest import load_manifest
from trt_spec.runtime.corpus import (PROB_SCALE, CorpusTable, build_table,
                                               context_keys, window_keys)
from trt_spec.runtime.proposers.suffix import SuffixProposer, corpus_key
from trt_spec.runtime.sampling import SamplingParams
from trt_spec.runtime.settings import SpeculationConfig
from trt_spec.runtime.scheduler import generate_ids

GREEDY = SamplingParams(max_tokens=40, ignore_eos=True)


def counted(seqs, max_n, min_total, min_prob):
    """The reference: per (n, n-gram), the set of its most frequent successors and their share."""
    out = {}
    for n in range(1, max_n + 1):
        follow = defaultdict(Counter)
        for s in seqs:
            for e in range(n - 1, len(s) - 1):
                follow[tuple(s[e - n + 1:e + 1])][s[e + 1]] += 1
        for gram, c in follow.items():
            total, best = sum(c.values()), max(c.values())
            if total >= min_total and best / total >= min_prob:
                out[(n, gram)] = ({t for t, v in c.items() if v == best}, best / total)
    return out


@pytest.mark.parametrize("min_total,min_prob", [(1, 0.0), (2, 0.0), (3, 0.5)])
def test_table_holds_what_counting_gives(min_total, min_prob):
    rng = random.Random(min_total)
    seqs = [[rng.randrange(5) for _ in range(rng.randrange(1, 40))] for _ in range(150)]
    table = CorpusTable(build_table(seqs, 4, min_total, min_prob), 4)
    ref = counted(seqs, 4, min_total, min_prob)
    assert len(table) == len(ref) > 0
    for (n, gram), (best, share) in ref.items():
        key = np.uint64(context_keys(list(gram), 4)[n - 1])
        i = int(np.searchsorted(table.keys, key))
        assert table.keys[i] == key, (n, gram)
        assert int(table.tokens[i]) in best
        assert table.probs[i] == pytest.approx(share, abs=0.5001 / PROB_SCALE)  # uint8 rounding


def test_window_keys_are_the_context_keys_of_each_window():
    tokens = np.array([3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5], dtype=np.int64)
    for n, keys in window_keys(tokens, 5):
        for i, key in enumerate(keys):
            window = tokens[i:i + n].tolist()
            assert int(key) == context_keys(window, 5)[n - 1]
    # different orders and different tokens never share a key here
    all_keys = [k for n in range(1, 6) for k in context_keys([7, 8, 9, 10, 11][:n], 5)]
    assert len(set(all_keys)) == len(all_keys)


def test_no_ngram_spans_two_answers():
    table = CorpusTable(build_table([[1, 2], [3, 4]] * 3, 3, 1, 0.0), 3)
    assert table.next([2, 3], min_n=2) is None  # "2 3" only across the boundary
    assert table.next([1], min_n=1)[:2] == (2, 1.0)
    assert table.next([2], min_n=1) is None  # 2 ends its answer: nothing follows it


def test_chain_follows_the_longest_order_and_stops_at_a_weak_share():
    seqs = [[10, 11, 12, 13, 14]] * 4 + [[11, 12, 20]] * 2 + [[5, 12, 21], [6, 12, 22]]
    table = CorpusTable(build_table(seqs, 4, 1, 0.0), 4)
    tokens, shares = table.chain([10, 11, 12], 5, min_n=2, min_prob=0.3)
    assert tokens.tolist() == [13, 14]  # "10 11 12" -> 13 (4 of 4), then 14; 14 ends them
    assert shares == [1.0, 1.0]
    # from "11 12" alone: 13 four times of six, then on
    tokens, shares = table.chain([99, 11, 12], 5, min_n=2, min_prob=0.3)
    assert tokens.tolist() == [13, 14] and shares[0] == pytest.approx(4 / 6, abs=0.01)
    assert table.chain([99, 11, 12], 1)[0].tolist() == [13]  # k bounds it
    # "x 12" after a token never seen before 12: the 1-gram "12" alone is below min_n
    assert table.chain([77, 12], 3, min_n=2)[0].tolist() == []
    # a share below min_prob stops the chain before that token
    assert table.chain([99, 11, 12], 5, min_n=2, min_prob=0.7)[0].tolist() == []


def test_save_load_roundtrip_and_refusals(tmp_path):
    table = CorpusTable(build_table([[1, 2, 3, 1, 2, 4]] * 3, 3, 1, 0.0), 3)
    table.save(tmp_path / "c.npz")
    again = CorpusTable.load(tmp_path / "c.npz")
    assert again.max_n == 3 and np.array_equal(again.keys, table.keys)
    assert np.array_equal(again.tokens, table.tokens) and np.allclose(again.probs, table.probs)
    np.savez(tmp_path / "other.npz", x=np.zeros(3))
    with pytest.raises(ValueError, match="not a corpus table"):
        CorpusTable.load(tmp_path / "other.npz")
    with pytest.raises(ValueError, match="not sorted"):
        CorpusTable({"keys": np.array([5, 1], np.uint64), "tokens": np.zeros(2),
                     "probs": np.zeros(2)})
    with pytest.raises(ValueError, match="max_n 0"):
        build_table([[1, 2]], max_n=0)


def stream(prompt, output, sid=0):
    return SimpleNamespace(prompt_ids=list(prompt), output_ids=list(output), slot=0, id=sid,
                           params=SamplingParams())


def test_suffix_lookup_asks_the_corpus_where_its_own_match_is_short():
    table = CorpusTable(build_table([[40, 41, 42, 43, 44]] * 3, 4, 1, 0.0), 4)
    lookup = SuffixProposer(1, 4, corpus=lambda: table)
    # nothing of its own matches: the corpus continues "41 42"
    drafts, key = lookup.draft_n(stream([1, 2, 3, 41, 42], []), 3)
    assert drafts.tolist() == [43, 44] and key == corpus_key(1.0) == "c3"
    # its own 2-token match wins over the corpus
    s = stream([7, 41, 42, 9, 9, 3, 41, 42], [], sid=1)
    drafts, key = lookup.draft_n(s, 2)
    assert drafts.tolist() == [9, 9] and key == 2
    # a 1-token match of its own says less than the corpus's phrase
    s = stream([42, 5, 5, 41, 42], [], sid=2)
    assert lookup.draft_n(s, 2)[0].tolist() == [43, 44]
    # no corpus: the lookup as before
    assert SuffixProposer(1, 4).draft_n(stream([42, 5, 5, 41, 42], [], sid=3), 2)[1] == 1
    assert [corpus_key(p) for p in (0.3, 0.5, 0.69, 0.7, 0.95)] == ["c0", "c1", "c1", "c2", "c3"]


@pytest.fixture
def corpus_engine(tiny_spec_engine, tmp_path):
    """A copy of the tiny engine (with its vanilla draft) whose corpus table holds its own
    greedy answers."""
    folder = tmp_path / "tiny-corpus"
    shutil.copytree(tiny_spec_engine, folder)
    prompts = [[5, 17, 99, 3], [42, 8, 77, 61, 23]]
    answers = [s.output_ids for s in generate_ids(Generator(folder, max_batch=2), prompts, GREEDY)]
    add_corpus(folder, sequences=answers * 3, max_n=4, min_total=1, progress=lambda m: None)
    return folder, prompts, answers


@pytest.mark.parametrize("method", ["suffix", "hybrid", "auto"])
def test_corpus_drafts_and_greedy_output_stays_plain(corpus_engine, method):
    folder, prompts, answers = corpus_engine
    # the gain rules off: they weigh measured step costs, and τ here must not hang on timing
    gen = Generator(folder, method=method, max_batch=1,
                    speculation=SpeculationConfig(num_draft_tokens=4, fallback=False))
    for prompt, answer in zip(prompts, answers):
        (s,) = generate_ids(gen, [prompt], GREEDY)
        assert s.output_ids == answer
        assert s.metrics().tau > 1.5  # its own answers, looked up: long runs accepted
    off = Generator(folder, method=method, max_batch=1,
                    speculation=SpeculationConfig(num_draft_tokens=4, corpus=False))
    assert off.corpus() is None and gen.corpus() is not None
    (s,) = generate_ids(off, [prompts[0]], GREEDY)
    assert s.output_ids == answers[0]


def test_add_corpus_is_checksummed_and_removable(corpus_engine, tmp_path):
    folder, _, _ = corpus_engine
    manifest = load_manifest(folder)  # sha256 of every file, corpus.npz included
    assert CORPUS_FILE in manifest.data["files"]
    entry = manifest.data["corpus"]
    assert entry["file"] == CORPUS_FILE and entry["entries"] > 0 and entry["answers"] == 6
    said = []
    add_corpus(folder, sequences=[[1, 2, 3]] * 3, max_n=4, min_total=1, progress=said.append)
    assert load_manifest(folder).data["corpus"]["answers"] == 3  # other answers: rebuilt
    add_corpus(folder, sequences=[[1, 2, 3]] * 3, max_n=4, min_total=1, progress=said.append)
    assert "up to date" in said[-1]
    (folder / CORPUS_FILE).write_bytes(b"corrupt")
    with pytest.raises(ValueError, match="corpus.npz"):
        load_manifest(folder)
    add_corpus(folder, sequences=[[1, 2, 3]] * 3, max_n=4, min_total=1, progress=said.append)
    assert "up to date" not in said[-1]  # a corrupt table is built again
    load_manifest(folder)
    graph = folder / "target.onnx"
    saved = graph.read_bytes()
    graph.write_bytes(saved[:-1] + bytes([saved[-1] ^ 1]))
    with pytest.raises(ValueError, match="target.onnx: checksum differs"):
        add_corpus(folder, sequences=[[4, 5]] * 3, progress=said.append)  # not blessed
    graph.write_bytes(saved)
    remove_corpus(folder)
    data = load_manifest(folder).data
    assert "corpus" not in data and CORPUS_FILE not in data["files"]
    assert not (folder / CORPUS_FILE).exists()
    assert Generator(folder, method="suffix").corpus() is None


def test_distilled_answers_read_shards_and_refuse_another_vocabulary(tmp_path):
    np.savez(tmp_path / "shard-00000.npz", offsets=np.array([0, 3, 5]),
             tokens=np.array([1, 2, 3, 4, 5], dtype=np.uint16))
    assert distilled_answers(tmp_path, 10) == [[1, 2, 3], [4, 5]]
    with pytest.raises(ValueError, match="outside this engine's vocabulary"):
        distilled_answers(tmp_path, 5)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no shard"):
        distilled_answers(tmp_path / "empty", 10)


def test_cli_corpus_refuses_nothing_to_index_and_removes(corpus_engine):
    folder, _, _ = corpus_engine
    runner = CliRunner()
    r = runner.invoke(main, ["corpus", "--engine", str(folder), "--conversations", "0"])
    assert r.exit_code == 1 and "no answers to build from" in r.output
    r = runner.invoke(main, ["corpus", "--engine", str(folder), "--remove"])
    assert r.exit_code == 0 and "removed" in r.output
    assert "corpus" not in json.loads((folder / "manifest.json").read_text())
    r = runner.invoke(main, ["corpus", "--help"])
    assert r.exit_code == 0 and "--distilled" in r.output
    for command in ("generate", "serve", "bench"):
        r = runner.invoke(main, [command, "--help"])
        assert "--no-corpus" in r.output, command


def test_bundle_takes_the_table_with_a_lookup_method_only(corpus_engine, tmp_path):
    from trt_spec.tools.bundle import bundle

    folder, prompts, answers = corpus_engine
    with_lookup = bundle(folder, tmp_path / "edge-suffix", methods=["suffix"])
    data = load_manifest(with_lookup).data  # checksums of the copied table included
    assert data["corpus"]["file"] == CORPUS_FILE and (with_lookup / CORPUS_FILE).is_file()
    gen = Generator(with_lookup, method="suffix", max_batch=1,
                    speculation=SpeculationConfig(num_draft_tokens=4, fallback=False))
    (s,) = generate_ids(gen, [prompts[0]], GREEDY)
    assert s.output_ids == answers[0] and s.metrics().tau > 1.5
    plain = bundle(folder, tmp_path / "edge-vanilla", methods=["vanilla"])
    data = load_manifest(plain).data
    assert "corpus" not in data and not (plain / CORPUS_FILE).exists()


def test_suffix_verifies_what_pays_by_what_found_the_draft():
    """Under the gain rules a fixed-k suffix draft is cut to the length its finder's measured
    acceptance pays for (an own 2-gram match: as long as pays; a weak corpus bin: nothing,
    but probes);
    without the rules, all of it. Acceptance is keyed by the finder (Drafts.keys)."""
    from trt_spec.runtime.speculation.draft_length import DraftLength
    from trt_spec.runtime.speculation.policy import PROBE_EVERY, SURE_LOSS_SPACING

    rule = DraftLength()
    for t, ms in ((1, 10), (2, 12), (3, 15), (4, 19), (5, 24)):
        rule.costs.record(1, t, ms / 1000)
    for key, rates in (("2", [0.9, 0.8, 0.7, 0.6]), ("c3", [0.05, 0.0, 0.0, 0.0])):
        acc = rule.acceptance(f"suffix:{key}", False)
        acc.proposed, acc.accepted = [300.0] * 4, [300.0 * a for a in rates]
    table = CorpusTable(build_table([[40, 41, 42, 43, 44, 45]] * 3, 4, 1, 0.0), 4)
    own = stream([7, 41, 42, 9, 8, 7, 6, 3, 41, 42], [], sid=1)  # its own 2-gram: 9 8 7 6
    corpus_only = stream([1, 2, 3, 41, 42], [], sid=2)  # the corpus: 43 44 45
    for measured in (True, False):
        lookup = SuffixProposer(1, 4, corpus=lambda: table, measured=lambda: measured)
        d = lookup.propose([own, corpus_only], [4, 4], rule.gate("suffix", [False, False], 1))
        # 2 drafts: (1 + 0.9 + 0.8) / 1.5 = 1.8 a cost unit, above 1, 3 and 4 drafts
        assert d.tokens[0].tolist() == ([9, 8] if measured else [9, 8, 7, 6])
        assert d.keys[0] == "2" and d.sources[0] == "suffix"
        if measured:  # 1.05 / 1.2: a sure loss, not probed on the first step
            assert len(d.tokens[1]) == 0 and d.keys[1] is None and d.sources[1] is None
        else:
            assert d.tokens[1].tolist() == [43, 44, 45] and d.keys[1] == "c3"
    steps = PROBE_EVERY * SURE_LOSS_SPACING
    lookup = SuffixProposer(1, 4, corpus=lambda: table, measured=lambda: True)
    drafted = [len(lookup.propose([corpus_only], [4], rule.gate("suffix", [False], 1)).tokens[0])
               for _ in range(steps)]
    assert drafted[-1] == 1 and sum(drafted) == 1  # one probe, of the length that pays best
    # an adaptive stream (k = auto) is judged so too (the engine then cuts by position)
    d = lookup.propose([own], [4], rule.gate("suffix", [True], 1))
    assert d.tokens[0].tolist() == [9, 8]
    lookup.release(corpus_only)
    assert not lookup.skipped


@pytest.mark.slow
def test_real_sharegpt_table_skips_held_out_and_stays_lossless(smollm2_int4_spec_engine,
                                                                tmp_path):
    """SmolLM2 int4 with a table of 60 ShareGPT conversations' answers (the training split):
    held-out conversations are left out, and greedy output with it stays plain's."""
    from trt_spec.tools.bench import load_prompts
    from trt_spec.export.sharegpt import fetch_sharegpt, read_conversations, split

    folder = tmp_path / "smollm2-corpus"
    shutil.copytree(smollm2_int4_spec_engine, folder)
    said: list[str] = []
    entry = add_corpus(folder, conversations=60, max_n=6, progress=said.append)
    _, heldout = split(read_conversations(fetch_sharegpt(), limit=60)[0])
    assert f"({len(heldout)} held-out ones left out)" in said[0]
    assert entry["entries"] > 10_000 and entry["tokens"] > 20_000
    add_corpus(folder, conversations=60, max_n=6, progress=said.append)
    assert "up to date" in said[-1]  # known from its sources' names alone: nothing re-read
    prompts = load_prompts("runtime/data/sharegpt-heldout.jsonl")[:2]
    params = SamplingParams(max_tokens=48, ignore_eos=True)
    gen = Generator(folder, max_batch=1, speculation=SpeculationConfig(num_draft_tokens=4,
                                                                       fallback=False))
    ids = [gen.encode(p) for p in prompts]
    plain = [s.output_ids for s in generate_ids(gen, ids, params, "none")]
    streams = generate_ids(gen, ids, params, "suffix")
    assert [s.output_ids for s in streams] == plain
    assert sum(s.metrics().accepted_tokens for s in streams) > 0
