"""A tiny Hugging Face model (tests/rope_models.py) written as a GGUF the way llama.cpp's
convert_hf_to_gguf.py writes it, for the GGUF column of scripts/families_table.py and
tests/test_families_gguf.py.

What is written, as llama.cpp does: the architecture's name (llama, qwen2, qwen3, phi3; Mistral
is llama with "mistral" in general.name), the hyperparameters under "{arch}.", the tensors
under gguf's own name map (Phi-3's qkv_proj and gate_up_proj stay fused: attn_qkv, ffn_up),
the q / k rows of the llama architecture reordered as RoPE pairs (export/gguf_draft.py
to_gguf_rows), no output.weight when the head is tied, and the RoPE scaling as llama.cpp
stores it: linear and yarn as rope.scaling.{type, factor, original_context_length}, llama3
as a `rope_freqs` tensor of per-frequency divisors, longrope as `rope_factors_long` /
`rope_factors_short` tensors; dynamic NTK has no GGUF form. Every tensor is F32 (the
comparison is of the format, not of a quantizer). The tokenizer is a "gpt2" one of the tiny
model's words (no merges): what transformers needs to load the file, not a real tokenizer.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

ARCHS = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "llama",
         "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3", "Phi3ForCausalLM": "phi3"}


def rope_parameters(config: dict) -> dict:
    """transformers 5 saves theta and the scaling together as rope_parameters (4: rope_theta
    and rope_scaling apart)."""
    if "rope_parameters" in config:
        return config["rope_parameters"]
    scaling = config.get("rope_scaling") or {}
    return {**scaling, "rope_type": scaling.get("rope_type", scaling.get("type", "default")),
            "rope_theta": config.get("rope_theta", 10000.0)}


def llama3_rope_freqs(config: dict, rotary_dim: int) -> np.ndarray:
    """llama.cpp's rope_freqs for a llama3 rope_scaling: per frequency, the divisor of
    1 / theta^(2i/d) (1 for high frequencies, factor for low, smooth between) [rotary_dim/2]."""
    s = rope_parameters(config)
    base = s["rope_theta"]
    freqs = 1.0 / base ** (np.arange(0, rotary_dim, 2, dtype=np.float64) / rotary_dim)
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old = s["original_max_position_embeddings"]
    wavelen = 2 * np.pi / freqs
    smooth = (old / wavelen - low) / (high - low)
    out = np.where(wavelen < old / high, 1.0,
                   np.where(wavelen > old / low, factor, 1.0 / ((1 - smooth) / factor + smooth)))
    return out.astype(np.float32)


def write_metadata(w, config: dict, arch: str, name: str, head_dim: int, rotary_dim: int) -> None:
    import gguf

    w.add_name(name)
    w.add_context_length(config["max_position_embeddings"])
    w.add_block_count(config["num_hidden_layers"])
    w.add_embedding_length(config["hidden_size"])
    w.add_feed_forward_length(config["intermediate_size"])
    w.add_head_count(config["num_attention_heads"])
    w.add_head_count_kv(config.get("num_key_value_heads") or config["num_attention_heads"])
    w.add_layer_norm_rms_eps(config["rms_norm_eps"])
    w.add_rope_freq_base(rope_parameters(config)["rope_theta"])
    w.add_rope_dimension_count(rotary_dim)
    if head_dim != config["hidden_size"] // config["num_attention_heads"]:
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    w.add_vocab_size(config["vocab_size"])
    window = config.get("sliding_window")
    if window and config.get("use_sliding_window", True):
        w.add_sliding_window(window)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    scaling = rope_parameters(config)
    kind = scaling["rope_type"]
    if kind == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(scaling["factor"])
    elif kind == "yarn":
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(scaling["factor"])
        w.add_rope_scaling_orig_ctx_len(scaling["original_max_position_embeddings"])
    elif kind == "longrope":
        w.add_rope_scaling_orig_ctx_len(config["original_max_position_embeddings"])


def write_tokenizer(w, folder: Path, config: dict) -> None:
    vocab = json.loads((folder / "tokenizer.json").read_text())["model"]["vocab"]
    tokens = sorted(vocab, key=vocab.get)
    assert len(tokens) == config["vocab_size"], (len(tokens), config["vocab_size"])
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([3 if t.startswith("<") else 1 for t in tokens])  # control / normal
    w.add_token_merges([])
    w.add_token_scores([0.0] * len(tokens))  # transformers reads them when there are no merges
    w.add_bos_token_id(config["bos_token_id"])
    w.add_eos_token_id(config["eos_token_id"])
    w.add_pad_token_id(config["pad_token_id"])


def write_gguf(folder: str | Path, out: str | Path, name: str) -> Path:
    """The Hugging Face folder `folder` (one of tests/rope_models.py) -> the F32 GGUF `out`."""
    import gguf
    from safetensors.numpy import load_file

    from trt_spec.export.gguf_draft import to_gguf_rows

    folder, out = Path(folder), Path(out)
    config = json.loads((folder / "config.json").read_text())
    arch = ARCHS[config["architectures"][0]]
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    rotary_dim = int(head_dim * config.get("partial_rotary_factor", 1.0))
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], config["num_hidden_layers"])

    w = gguf.GGUFWriter(out, arch)
    write_metadata(w, config, arch, name, head_dim, rotary_dim)
    write_tokenizer(w, folder, config)
    for key, array in load_file(folder / "model.safetensors").items():
        base, suffix = key.rsplit(".", 1)
        if base == "lm_head" and config.get("tie_word_embeddings"):
            continue
        gguf_name = names.get_name(base)
        if gguf_name is None:
            raise ValueError(f"{folder}: tensor {key!r} has no GGUF name in {arch}")
        array = array.astype(np.float32)
        if arch == "llama" and base.endswith(("q_proj", "k_proj")):
            # llama.cpp's permute: each head's halves -> interleaved RoPE pairs
            array = to_gguf_rows(array.reshape(array.shape[0], -1),
                                 heads if base.endswith("q_proj") else kv_heads
                                 ).reshape(array.shape)
        w.add_tensor(f"{gguf_name}.{suffix}", np.ascontiguousarray(array))
    scaling = rope_parameters(config)
    kind = scaling["rope_type"]
    if kind == "llama3":
        w.add_tensor("rope_freqs.weight", llama3_rope_freqs(config, rotary_dim))
    elif kind == "longrope":
        w.add_tensor("rope_factors_long.weight", np.asarray(scaling["long_factor"], np.float32))
        w.add_tensor("rope_factors_short.weight", np.asarray(scaling["short_factor"], np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out
