"""--draft-vocab: the MTP, Eagle and vanilla-draft heads over a reduced draft vocabulary.

The exported restricted head computes the full head's columns at the draft vocabulary's
target ids (torch and ORT); the proposers map draft ids to target ids as Eagle3 does (one
shared pick_draft); greedy output stays the plain greedy output, sampled q stays a
distribution over the mapped ids; bad values are refused, quoting them."""

import copy

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from click.testing import CliRunner  # noqa: E402

from trt_spec.cli import main  # noqa: E402
from trt_spec.export.checkpoint import load_target  # noqa: E402
from trt_spec.export.config import resolve_draft_vocab  # noqa: E402
from trt_spec.export.drafters import head_vocab, restrict_head  # noqa: E402
from trt_spec.export.model import empty_cache  # noqa: E402
from trt_spec.export.onnx_export import export_drafter, export_target  # noqa: E402
from trt_spec.export.pipeline import truncated_draft  # noqa: E402
from trt_spec.runtime.backends.ort import OrtTarget  # noqa: E402
from trt_spec.runtime.stream import Stream  # noqa: E402
from trt_spec.runtime.generator import Generator  # noqa: E402
from trt_spec.runtime.kv_cache import KVCache  # noqa: E402
from trt_spec.runtime.manifest import load_manifest  # noqa: E402
from trt_spec.runtime.methods import Speculation  # noqa: E402
from trt_spec.runtime.settings import SpeculationConfig  # noqa: E402
from trt_spec.runtime.proposers.base import DraftVocab, pick_draft  # noqa: E402
from trt_spec.runtime.sampling import SamplingParams  # noqa: E402
from trt_spec.runtime.step_inputs import SlotTokens  # noqa: E402
from trt_spec.runtime.scheduler import generate_ids

PROMPTS = [[5, 17, 99, 3, 17, 99], [42, 8, 77, 61, 23, 11, 90, 8, 77]]
GREEDY = SamplingParams(max_tokens=24, ignore_eos=True)
TOKENS = [5, 17, 99, 3, 42, 8]
VOCAB = 128  # the tiny model's (tests/conftest.py)


def draft_map(n: int, seed: int) -> torch.Tensor:
    """A random draft vocabulary of n target ids in id order -> d2t [n] int64."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.sort(torch.randperm(VOCAB, generator=g)[:n]).values
    return ids - torch.arange(n)


@pytest.fixture(scope="module")
def target(tiny_hf_dir):
    model, _ = load_target(tiny_hf_dir)
    return model


# --- the exported head: the full head's columns at the mapped ids --------------------------

def drafter_logits(module, hidden: torch.Tensor) -> torch.Tensor:
    """One step of an MTP / Eagle module over TOKENS: logits [T, head_vocab]."""
    t = len(TOKENS)
    with torch.no_grad():
        logits, *_ = module(torch.tensor([TOKENS]), hidden[None], torch.arange(t)[None],
                            torch.tensor([t - 1], dtype=torch.int32),
                            torch.tensor([t], dtype=torch.int32),
                            torch.tensor(t, dtype=torch.int32), torch.arange(t)[None],
                            *empty_cache(module.config, 1, 16))
    return logits[0]


def target_logits(model) -> torch.Tensor:
    """One step of a target-style graph (the vanilla draft) over TOKENS: [T, head_vocab]."""
    t = len(TOKENS)
    with torch.no_grad():
        logits, *_ = model(torch.tensor([TOKENS]), torch.arange(t)[None],
                           torch.tensor([t - 1], dtype=torch.int32),
                           torch.tensor([t], dtype=torch.int32), torch.tensor(t, dtype=torch.int32),
                           torch.arange(t)[None], *empty_cache(model.config, 1, 16))
    return logits[0]


def ort_logits(path, config, num_layers: int, hidden: np.ndarray | None) -> np.ndarray:
    graph = OrtTarget(path, num_layers, config.max_position_embeddings)
    cache = KVCache(config, slots=1, max_len=16, num_layers=num_layers)
    request = SlotTokens(cache.allocate(), TOKENS, list(range(len(TOKENS))), hidden)
    out = graph.step(cache, [request], ("next_hidden_states",) if hidden is not None else ())
    return out.logits[0]


def test_restricted_module_head(target, tmp_path):
    """An MTP / Eagle module whose head is the target's (tied to the embedding): restricted,
    torch and ORT give the full head's logits at the draft vocabulary's target ids."""
    from tests.random_drafters import random_mtp

    full = random_mtp(target, 1, seed=21).modules[0].eval()
    d2t = draft_map(40, seed=1)
    ids = torch.arange(40) + d2t
    hidden = torch.randn(len(TOKENS), target.config.hidden_size,
                         generator=torch.Generator().manual_seed(2))
    want = drafter_logits(full, hidden)[:, ids]
    small = copy.deepcopy(full)
    restrict_head(small, d2t)
    assert head_vocab(full) == VOCAB and head_vocab(small) == 40
    torch.testing.assert_close(small.embed_tokens.weight, full.embed_tokens.weight)  # stays full
    torch.testing.assert_close(drafter_logits(small, hidden), want, atol=1e-5, rtol=1e-5)
    export_drafter(small, 40, tmp_path / "m.onnx")
    got = ort_logits(tmp_path / "m.onnx", small.config, 1, hidden.numpy())
    assert got.shape == (len(TOKENS), 40)
    np.testing.assert_allclose(got, want.numpy(), atol=1e-4)


def test_restricted_vanilla_head(target, tmp_path):
    """The vanilla draft (a target-style graph with a head tied to its embedding): its head
    becomes the embedding's rows at the mapped ids; input ids still index the full table."""
    full = truncated_draft(target, 2)
    d2t = draft_map(40, seed=3)
    want = target_logits(full)[:, torch.arange(40) + d2t]
    small = copy.deepcopy(full)
    restrict_head(small, d2t)
    torch.testing.assert_close(target_logits(small), want, atol=1e-5, rtol=1e-5)
    export_target(small, tmp_path / "draft.onnx")
    got = ort_logits(tmp_path / "draft.onnx", small.config, 2, None)
    assert got.shape == (len(TOKENS), 40)
    np.testing.assert_allclose(got, want.numpy(), atol=1e-4)


def test_manifest_records_the_maps(tiny_vocab_engine):
    manifest = load_manifest(tiny_vocab_engine)
    drafters = manifest.data["drafters"]
    e3 = np.load(tiny_vocab_engine / "eagle3_d2t.npy")
    for kind in ("mtp", "eagle", "vanilla"):
        entry = drafters[kind]
        assert entry["d2t"] == f"{kind}_d2t.npy" and entry["draft_vocab_size"] == 48
        assert entry["d2t"] in manifest.data["files"]  # checksummed like the graphs
        np.testing.assert_array_equal(np.load(tiny_vocab_engine / entry["d2t"]), e3)
    for graph in ("draft", "mtp_0", "mtp_1", "mtp_2", "eagle", "eagle3"):
        assert manifest.graph(graph)["outputs"][0]["shape"][-1] == 48, graph
    assert manifest.graph("target")["outputs"][0]["shape"][-1] == VOCAB
    assert manifest.data["source"]["draft_vocab"] == "eagle3"


def test_full_heads_have_no_map(tiny_heads_engine):
    """--draft-vocab none: the entries look like those of folders exported before the option
    (no d2t), and the proposers draft over the whole vocabulary."""
    drafters = load_manifest(tiny_heads_engine).data["drafters"]
    assert "d2t" not in drafters["mtp"] and "d2t" not in drafters["eagle"]
    gen = Generator(tiny_heads_engine)
    assert gen.proposer("mtp").vocab is None
    assert gen.proposer("eagle3").vocab is not None


# --- the mapping -----------------------------------------------------------------------------

def test_pick_draft_maps_ids():
    """Logits of +100 force the argmax; greedy returns its target id, sampling a q over the
    target vocabulary that is the draft distribution placed at the mapped ids."""
    d2t = draft_map(40, seed=4).numpy()
    vocab = DraftVocab(d2t, VOCAB)
    ids = np.arange(40) + d2t
    greedy = Stream([1], SamplingParams())
    for d in (0, 17, 39):
        logits = np.full(40, -100.0)
        logits[d] = 100.0
        assert pick_draft(greedy, logits, vocab) == (int(ids[d]), None)
        assert pick_draft(greedy, logits) == (d, None)  # no vocab: ids are target ids
    sampled = Stream([1], SamplingParams(temperature=0.7, top_k=10, seed=5))
    logits = np.random.default_rng(6).normal(size=40)
    for _ in range(50):
        token, q = pick_draft(sampled, logits, vocab)
        assert q.shape == (VOCAB,) and token in ids and q[token] > 0
        np.testing.assert_allclose(q.sum(), 1)
        assert (q[np.setdiff1d(np.arange(VOCAB), ids)] == 0).all()
        assert (q > 0).sum() == 10  # top-k over the draft vocabulary


def test_draft_vocab_refuses_bad_maps():
    with pytest.raises(ValueError, match="outside the target vocabulary 0..127"):
        DraftVocab(np.array([0, 0, 200]), VOCAB)
    with pytest.raises(ValueError, match="two draft ids to one target id"):
        DraftVocab(np.array([5, 4]), VOCAB)


# --- end to end over the exported graphs ---------------------------------------------------

@pytest.fixture(scope="module")
def plain_outputs(tiny_vocab_engine):
    gen = Generator(tiny_vocab_engine, max_batch=2)
    return [s.output_ids for s in generate_ids(gen, PROMPTS, GREEDY)]


@pytest.mark.parametrize("method", ["mtp", "eagle", "vanilla"])
@pytest.mark.parametrize("k", [1, 2, 4])
@pytest.mark.parametrize("batch", [1, 2])
def test_greedy_restricted_heads_equal_plain(tiny_vocab_engine, plain_outputs, method, k, batch):
    # every step drafts (no fallback, though random heads do not pay): the proposer is tested
    gen = Generator(tiny_vocab_engine, max_batch=batch, fallback=False)
    assert len(gen.proposer(method).vocab) == 48
    streams = generate_ids(gen, PROMPTS[:batch], GREEDY, method, k)
    assert [s.output_ids for s in streams] == plain_outputs[:batch]
    for s in streams:  # every step but prefill and the last one drafted: speculation ran
        assert s.stats.proposed_per_position[0] >= s.stats.target_forwards - 2


@pytest.mark.parametrize("method", ["mtp", "eagle", "vanilla"])
def test_sampled_restricted_heads(tiny_vocab_engine, method):
    """Drafts are target ids in the draft vocabulary, q sums to 1 over them and is zero
    elsewhere; a whole sampled run completes with valid tokens."""
    gen = Generator(tiny_vocab_engine, max_batch=2)
    engine, proposer = gen.engine, gen.proposer(method)
    mapped = proposer.vocab.draft_to_target
    outside = np.setdiff1d(np.arange(VOCAB), mapped)
    params = SamplingParams(max_tokens=8, temperature=0.8, top_p=0.9, seed=1, ignore_eos=True)
    streams = [gen.stream(p, params, Speculation(method, 3)) for p in PROMPTS]
    for s in streams:
        engine.admit(s)
    engine.step(streams)  # prefill
    drafts = proposer.propose(streams, [3, 3])
    for tokens, q in zip(drafts.tokens, drafts.probs):
        assert q.shape == (3, VOCAB) and np.isin(tokens, mapped).all()
        np.testing.assert_allclose(q[:, mapped].sum(-1), 1, atol=1e-6)
        assert (q[:, outside] == 0).all() and (q[np.arange(3), tokens] > 0).all()
    gen = Generator(tiny_vocab_engine, max_batch=2)
    run = generate_ids(gen, PROMPTS, SamplingParams(max_tokens=16, temperature=1.0, seed=2,
                                                   ignore_eos=True), method, 3)
    for s in run:
        assert len(s.output_ids) == 16 and all(0 <= t < VOCAB for t in s.output_ids)


# --- bad values ------------------------------------------------------------------------------

@pytest.mark.parametrize("value,heads,words", [
    ("8192", {"eagle3": "x"}, "'8192': a draft vocabulary of N tokens needs token frequencies"),
    ("top-8k", {"eagle3": "x"}, "'top-8k': expected one of eagle3, none"),
    ("eagle3", {"mtp": "x"}, "this export has no eagle3 drafter"),
])
def test_bad_draft_vocab(value, heads, words):
    with pytest.raises(ValueError, match=words):
        resolve_draft_vocab(value, heads)


@pytest.mark.parametrize("value,heads,want", [
    (None, {"eagle3": "x", "mtp": "y"}, "eagle3"), (None, {"mtp": "y"}, "none"),
    ("none", {"eagle3": "x"}, "none"), ("EAGLE3", {"eagle3": "x"}, "eagle3"),
])
def test_draft_vocab_default(value, heads, want):
    assert resolve_draft_vocab(value, heads) == want


def test_cli_refuses_a_bad_draft_vocab(tiny_hf_dir, tmp_path):
    """Refused before anything is loaded or written."""
    result = CliRunner().invoke(main, ["export", "--model", str(tiny_hf_dir), "--out",
                                       str(tmp_path / "x"), "--draft-vocab", "4096"])
    assert result.exit_code != 0
    assert "--draft-vocab '4096'" in result.output and "eagle3" in result.output
    assert not (tmp_path / "x").exists()
