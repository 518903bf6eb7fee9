"""RoPE scaling and Phi-3 through exported engines: the fp32 ORT graph against transformers
at positions below and above each scaling threshold, the runtime's greedy output, and every
speculative method lossless while its drafts straddle the longrope switch. One model per
RoPE kind (and the partial rotary and sliding-window shapes); scripts/families_table.py runs
every model of tests/rope_models.py through the same ORT comparison."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from tests.rope_models import cached_logits, greedy_cached, hf_model, make_hf  # noqa: E402
from tests.test_rope import ATOL, RTOL, ids_of, span, step_sizes  # noqa: E402
from trt_spec.export.checkpoint import load_target  # noqa: E402
from trt_spec.runtime.scheduler import generate_ids  # noqa: E402

# llama3, yarn, dynamic NTK, longrope with partial rotary (linear is a static table like
# llama3; the sliding window's ORT form is tests/test_families.py's)
ENGINE_NAMES = ("llama3.1", "qwen2.5-yarn", "llama-dynamic", "phi4-mini")


@pytest.fixture(scope="module", params=ENGINE_NAMES)
def model_engine(request, tmp_path_factory):
    """The model exported fp32 for ORT."""
    from trt_spec.export.config import ExportConfig
    from trt_spec.export.pipeline import export_model

    name = request.param
    folder = make_hf(tmp_path_factory.mktemp(name), name)
    return name, folder, export_model(ExportConfig(
        str(folder), tmp_path_factory.mktemp("engines") / name, "fp32"))




def test_ort_graph_equals_transformers(model_engine):
    """The exported fp32 ORT graph (GroupQueryAttention with the tables; the partial rotary
    dim read from the cos_cache width), by teacher forcing in a prefill and 1- / 3-token
    steps across the threshold, two rows of different lengths: logits close to transformers'
    cached decoding and the argmax equal at every position."""
    from trt_spec.runtime.backends.ort import OrtTarget
    from trt_spec.runtime.kv_cache import KVCache
    from trt_spec.runtime.step_inputs import SlotTokens

    name, folder, engine = model_engine
    _, config = load_target(folder)
    prefill, total = span(name)
    target = OrtTarget(engine / "target.onnx", config.num_layers, config.max_position_embeddings)
    cache = KVCache(config, slots=2, max_len=total)
    seqs = [ids_of(total, seed=2), ids_of(total, seed=3)]
    slots = [cache.allocate() for _ in seqs]
    got = [[], []]
    starts = [0, 0]
    # row 1 runs one step behind row 0's sizes, so the rows' positions differ in each step
    sizes = step_sizes(prefill, total)
    plans = [sizes, [prefill - 1] + [1] + sizes[1:]]
    for i in range(max(len(p) for p in plans)):
        rows = []
        for r, (slot, seq) in enumerate(zip(slots, seqs)):
            n = plans[r][i] if i < len(plans[r]) else 0
            n = min(n, total - starts[r])
            rows.append((r, SlotTokens(slot, seq[starts[r]:starts[r] + n], list(range(n)))))
        rows = [(r, t) for r, t in rows if t.tokens]
        out = target.step(cache, [t for _, t in rows])
        for j, (r, t) in enumerate(rows):
            got[r].append(out.logits[j][:len(t.tokens)])
            starts[r] += len(t.tokens)
    assert starts == [total, total]
    for r, seq in enumerate(seqs):
        want = cached_logits(hf_model(folder), seq, prefill).numpy()
        row = np.concatenate(got[r])
        np.testing.assert_allclose(row, want, atol=ATOL, rtol=RTOL)
        assert (row.argmax(-1) == want.argmax(-1)).all()


def test_runtime_greedy_crossing_the_threshold(model_engine):
    """The runtime's greedy output from prompts just below the threshold, 16 tokens past
    it, equals transformers' cached greedy decoding."""
    from trt_spec.runtime.generator import Generator
    from trt_spec.runtime.sampling import SamplingParams

    name, folder, engine = model_engine
    prefill, total = span(name)
    prompts = [ids_of(prefill, seed=4), ids_of(prefill - 2, seed=5)]
    params = SamplingParams(max_tokens=total - prefill, ignore_eos=True)
    want = [greedy_cached(folder, p, total - prefill) for p in prompts]
    assert [s.output_ids for s in generate_ids(Generator(engine, max_batch=2), prompts,
                                               params)] == want


def test_speculative_greedy_equals_plain_across_the_threshold(tmp_path):
    """Every method (a 1-layer self-draft, random MTP and Eagle3 heads that take the
    target's RoPE) reproduces plain greedy while the drafts straddle the threshold: a
    token's scores do not depend on how many drafts share its step."""
    from tests.random_drafters import eagle3_tensors, random_mtp, write_checkpoint
    from trt_spec.export.config import ExportConfig
    from trt_spec.export.drafter_checkpoint import load_drafter, save_drafter
    from trt_spec.export.pipeline import export_model
    from trt_spec.runtime.generator import Generator
    from trt_spec.runtime.sampling import SamplingParams
    from trt_spec.runtime.settings import SpeculationConfig

    name = "phi3.5-mini"
    folder = make_hf(tmp_path / "hf", name)
    target, config = load_target(folder)
    save_drafter(random_mtp(target, 2, seed=11), tmp_path / "mtp")
    write_checkpoint(tmp_path / "eagle3", *eagle3_tensors(config, seed=13))
    eagle3 = load_drafter(tmp_path / "eagle3", "eagle3", target)
    assert eagle3.modules[0].config.rope_scaling == config.rope_scaling
    engine = export_model(ExportConfig(
        str(folder), tmp_path / "engine", "fp32", draft_layers=1,
        drafters={k: tmp_path / k for k in ("mtp", "eagle3")}))
    prefill, _ = span(name)
    prompts = [ids_of(prefill - 2, seed=6), ids_of(prefill, seed=7)]
    prompts[0] = prompts[0][:6] * 2 + prompts[0][12:]  # a repeat, so n-gram drafts something
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    plain = [s.output_ids for s in generate_ids(Generator(engine, max_batch=2), prompts, params)]
    for method in ("ngram", "vanilla", "mtp", "eagle3"):
        gen = Generator(engine, method=method, max_batch=2,
                        speculation=SpeculationConfig(num_draft_tokens=3))
        streams = generate_ids(gen, prompts, params)
        assert [s.output_ids for s in streams] == plain, method
        if method != "ngram":
            assert sum(s.stats.proposed for s in streams) > 0
