"""The torch-cuda backend on the CPU (device="cpu", CUDA graphs off): its shape-static in-place
attention equals the reference, and every method's greedy output equals the ORT backend's on a
tiny random model with random heads, with and without bucket padding."""

import json

import pytest

torch = pytest.importorskip("torch")

from trt_spec.plugins.attention import Heads, attention_reference  # noqa: E402
from trt_spec.export.torch_backend import (TorchGraphs, TorchKVCache,  # noqa: E402
                                                  attention_in_place)
from trt_spec.runtime.generator import Generator  # noqa: E402
from trt_spec.runtime.manifest import load_manifest  # noqa: E402
from trt_spec.runtime.sampling import SamplingParams  # noqa: E402
from trt_spec.runtime.scheduler import generate_ids

PROMPTS = [[5, 17, 99, 3, 17, 99], [42, 8, 77, 61, 23, 11, 90, 8, 77], [4, 4]]
GREEDY = SamplingParams(max_tokens=20, ignore_eos=True)
METHODS = ["none", "ngram", "vanilla", "mtp", "eagle", "eagle3"]


@pytest.mark.parametrize("past,query", [
    ([0, 0], [3, 3]),  # prefill, equal lengths
    ([4, 0], [1, 5]),  # decode beside a prefill: mixed lengths, right padding
    ([5, 2], [3, 0]),  # verify after a past beside an idle row
    ([7, 5], [1, 3]),  # the last cache row is written (past + query = max_len)
])
@pytest.mark.parametrize("window", [0, 3])  # 3: a sliding window shorter than the past
def test_attention_in_place_equals_reference(past, query, window):
    g = torch.Generator().manual_seed(0)
    batch, nh, kvh, hd, max_len, positions = 2, 4, 2, 8, 8, 32
    T = max(query)
    qkv = torch.randn(batch, T, (nh + 2 * kvh) * hd, generator=g)
    cache_k = torch.randn(batch, kvh, max_len, hd, generator=g)
    cache_v = torch.randn(batch, kvh, max_len, hd, generator=g)
    seqlens_k = torch.tensor([p + q - 1 if p + q else 0 for p, q in zip(past, query)],
                             dtype=torch.int32)
    query_seqlens = torch.tensor(query, dtype=torch.int32)
    pos = torch.stack([torch.clamp(torch.arange(p, p + T), max=p + max(q, 1) - 1)
                       for p, q in zip(past, query)])
    angles = torch.outer(torch.arange(positions).double(),
                         1.0 / 10000 ** (torch.arange(0, hd, 2).double() / hd))
    cos, sin = angles.cos().float(), angles.sin().float()
    want, want_k, want_v = attention_reference(qkv, cache_k, cache_v, seqlens_k, query_seqlens,
                                               pos, cos, sin, Heads(nh, kvh, window))
    # the in-place form's cache has one scratch row more
    k = torch.cat([cache_k, torch.zeros(batch, kvh, 1, hd)], 2)
    v = torch.cat([cache_v, torch.zeros(batch, kvh, 1, hd)], 2)
    got, got_k, got_v = attention_in_place(qkv, k, v, seqlens_k, query_seqlens, pos, None,
                                           cos, sin, Heads(nh, kvh, window))
    assert got_k is k and got_v is v  # in place
    for b, (p, q) in enumerate(zip(past, query)):
        torch.testing.assert_close(got[b, :q], want[b, :q])
        torch.testing.assert_close(k[b, :, :p + q], want_k[b, :, :p + q])
        torch.testing.assert_close(v[b, :, :p + q], want_v[b, :, :p + q])
        assert torch.isfinite(got[b]).all()  # padding rows: unspecified but finite


@pytest.fixture(scope="module")
def tiny_all_engine(tiny_hf_dir, tmp_path_factory):
    """The tiny target with every drafter: a 2-layer self-draft and random MTP / Eagle /
    Eagle3 heads (as tiny_heads_engine)."""
    from tests.conftest import export_tiny_with_heads

    return export_tiny_with_heads(tiny_hf_dir, tmp_path_factory, "tiny-all", draft_layers=2)


def run(gen: Generator, method: str, k: int = 3):
    return generate_ids(gen, PROMPTS, GREEDY, method, None if method == "none" else k)


@pytest.fixture(scope="module")
def ort_outputs(tiny_all_engine):
    gen = Generator(tiny_all_engine, max_batch=3, max_len=64)
    return {m: [s.output_ids for s in run(gen, m)] for m in METHODS}


@pytest.mark.parametrize("pad", [False, True])
def test_every_method_equals_ort(tiny_all_engine, ort_outputs, pad):
    """Greedy output token for token, batch 3, k = 3; with pad=True every step goes through
    the CUDA-graph buckets (idle rows, padded tokens and logits) as on a GPU."""
    manifest = load_manifest(tiny_all_engine)
    graphs = TorchGraphs.from_manifest(manifest, device="cpu", cuda_graphs=False, pad=pad)
    # the host loop's step() path (the device loop: tests/test_device_loop.py)
    gen = Generator.from_graphs(manifest, graphs, max_batch=3, max_len=64, executor="host")
    assert isinstance(gen.cache, TorchKVCache)
    for method in METHODS:
        streams = run(gen, method)
        assert [s.output_ids for s in streams] == ort_outputs[method], method
        assert ort_outputs[method] == ort_outputs["none"], method  # lossless, both backends
    stats = graphs.stats()
    assert set(stats) == {"target", "draft", "mtp_0", "mtp_1", "mtp_2", "eagle", "eagle3"}
    for s in stats.values():
        assert s["captured"] == 0 and s["eager"] > 0
        assert (s["bucketed"] == s["eager"]) if pad else s["bucketed"] == 0


def test_generator_backend_option(tiny_all_engine, ort_outputs):
    """Generator(backend="torch-cuda") loads the folder's source modules; LLM passes it on."""
    from trt_spec.runtime.api import LLM

    gen = Generator(tiny_all_engine, max_batch=3, max_len=64, backend="torch-cuda",
                    device="cpu", cuda_graphs=False)
    assert gen.backend == "torch-cuda"
    assert [s.output_ids for s in run(gen, "mtp")] == ort_outputs["mtp"]
    outs = [LLM(tiny_all_engine, max_num_seqs=1, max_model_len=64, **kw).generate(
                "hello world", GREEDY, method="eagle3", chat=False)[0].token_ids
            for kw in ({}, {"backend": "torch-cuda", "device": "cpu", "cuda_graphs": False})]
    assert outs[0] == outs[1]


def test_from_model_equals_engine_folder(tiny_all_engine, tiny_hf_dir, ort_outputs):
    """No engine folder: the modules straight from the model and the drafter folders."""
    from trt_spec.runtime.manifest import source_path

    folder = load_manifest(tiny_all_engine)
    heads = {k: source_path(folder, v) for k, v in folder.data["source"]["heads"].items()}
    graphs, manifest = TorchGraphs.from_model(str(tiny_hf_dir), heads,
                                              draft_layers=2, device="cpu", cuda_graphs=False,
                                              pad=True)
    gen = Generator.from_graphs(manifest, graphs, max_batch=3, max_len=64)
    for method in ("vanilla", "eagle3"):
        assert [s.output_ids for s in run(gen, method)] == ort_outputs[method]


def test_backend_errors(tiny_all_engine):
    with pytest.raises(ValueError, match="backend='tensorrt'"):
        Generator(tiny_all_engine, backend="tensorrt")
    with pytest.raises(ValueError, match="cuda_graphs needs a CUDA device"):
        from trt_spec.export.torch_backend import TorchTarget
        from trt_spec.export.model import TargetModel

        TorchTarget(TargetModel(load_manifest(tiny_all_engine).config), 256, "cpu",
                    cuda_graphs=True)


def test_cli_generate_backend(tiny_all_engine):
    from click.testing import CliRunner

    from trt_spec.cli import main

    outs = []
    for extra in ([], ["--backend", "torch-cuda", "--device", "cpu"]):
        r = CliRunner().invoke(main, ["generate", "--engine", str(tiny_all_engine), "--method",
                                      "mtp", "--max-tokens", "8", "--no-chat", "--json",
                                      *extra, "hello world"])
        assert r.exit_code == 0, r.output
        outs.append(json.loads(r.output.strip().splitlines()[-1])["token_ids"])
    assert outs[0] == outs[1]
