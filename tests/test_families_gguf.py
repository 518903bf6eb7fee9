"""The GGUF column of docs/families.md: a tiny Llama (llama3 RoPE) and a tiny Qwen2 written as
llama.cpp writes a GGUF (tests/gguf_models.py), exported from the .gguf the way `trt-spec
export --model FILE.gguf` does, and compared with transformers loading the same file."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("gguf")

from scripts.families_table import lost_in_gguf, ort_logits  # noqa: E402
from tests.gguf_models import write_gguf  # noqa: E402
from tests.rope_models import VOCAB, cached_logits, hf_model, make_hf  # noqa: E402
from tests.test_rope import ATOL, RTOL  # noqa: E402  the fp32 bound of the RoPE parity tests


@pytest.mark.parametrize("name", ["llama3.1", "qwen2.5"])
def test_gguf_export_equals_transformers_gguf_load(name, tmp_path, monkeypatch):
    from trt_spec.export.checkpoint import load_target, resolve_model
    from trt_spec.export.config import ExportConfig
    from trt_spec.export.pipeline import export_model

    monkeypatch.setenv("TRT_SPEC_CACHE", str(tmp_path / "cache"))
    folder = make_hf(tmp_path / name, name)
    (tmp_path / "gguf").mkdir()
    path = write_gguf(folder, tmp_path / "gguf" / f"{name}.gguf", name)
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32).eval()

    # the weights come back bitwise (F32; the llama q / k rows un-permuted)
    original = hf_model(folder)
    want_state = original.state_dict()
    for key, value in reference.state_dict().items():
        assert torch.equal(value, want_state[key]), key
    lost = lost_in_gguf(original.config, reference.config)
    if name == "llama3.1":  # llama.cpp keeps llama3 RoPE as rope_freqs; transformers drops it
        assert lost == "rope_type llama3 read back as default"
        with pytest.raises(ValueError, match="tensor 'rope_freqs.weight'"):  # so export refuses
            export_model(ExportConfig(str(path), tmp_path / "engine", "fp32"))
        assert not (tmp_path / "engine").exists()
        return
    assert lost is None

    engine = export_model(ExportConfig(str(path), tmp_path / "engine", "fp32"))
    config = load_target(resolve_model(str(path)))[1]
    ids = np.random.default_rng(0).integers(3, VOCAB, 72).tolist()  # past position 64
    want = cached_logits(reference, ids, 56).numpy()
    got = ort_logits(engine, config, ids, 56)
    np.testing.assert_allclose(got, want, atol=ATOL, rtol=RTOL)
    assert np.array_equal(got.argmax(-1), want.argmax(-1))


@pytest.mark.parametrize("name, words", [
    ("mistral", "llama.attention.sliding_window = 16 read back as 4096"),
    ("qwen3", "qwen3.attention.key_length = 32 (head_dim) read back as 128"),
    ("phi3.5-mini", "tensor 'rope_factors_long.weight'")])
def test_a_gguf_whose_fields_transformers_drops_is_refused_naming_them(name, words, tmp_path,
                                                                       monkeypatch):
    """Refused before a weight is read, naming the GGUF key and its value."""
    from trt_spec.export.checkpoint import resolve_model

    monkeypatch.setenv("TRT_SPEC_CACHE", str(tmp_path / "cache"))
    folder = make_hf(tmp_path / name, name)
    (tmp_path / "gguf").mkdir()
    path = write_gguf(folder, tmp_path / "gguf" / f"{name}.gguf", name)
    with pytest.raises(ValueError) as e:
        resolve_model(str(path))
    assert words in str(e.value) and "Hugging Face folder" in str(e.value)
