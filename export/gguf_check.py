"""What a GGUF states that transformers' GGUF reader (which `trt-spec export` reads a .gguf
through, export/checkpoint.py gguf_to_hf) does not give back: refused before any weight is
read, naming the key and its value, rather than exported as another model.

Measured on transformers 5.25 (scripts/families_table.py, the GGUF column of
docs/families.md): llama.cpp keeps llama3 RoPE as a `rope_freqs` tensor and longrope as
`rope_factors_long` / `rope_factors_short`, none of which the reader turns back into
rope_scaling; it reads `{arch}.rope.scaling.*` for one architecture only; a sliding window
may be dropped or replaced, and Qwen3's head_dim (`{arch}.attention.key_length`) is not read.
"""

from __future__ import annotations

from pathlib import Path

ROPE_TENSORS = ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight")
HINT = ("transformers' GGUF reader does not give it back, so the model would export wrong; "
        "export the model's Hugging Face folder (config.json + safetensors) or its hub name "
        "instead")


def field(reader, key: str):
    """A scalar or string metadata value of the GGUF (None when absent)."""
    f = reader.get_field(key)
    return None if f is None else f.contents()


def head_dim(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def rope_type(config) -> str:
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None)
    return (params or {}).get("rope_type", (params or {}).get("type", "default"))


def window(config) -> int | None:
    w = getattr(config, "sliding_window", None)
    return w if w and getattr(config, "use_sliding_window", True) else None


def check_kept(path: Path, config) -> None:
    """ValueError naming the GGUF key (and value) that `config` (transformers' reading of the
    file) lost; nothing when everything the decoder needs came back."""
    import gguf

    reader = gguf.GGUFReader(path)
    arch = field(reader, "general.architecture")
    where = f"{Path(path).name}"
    if rope_type(config) == "default":
        for tensor in reader.tensors:
            if tensor.name in ROPE_TENSORS:
                raise ValueError(f"{where}: RoPE scaling is stored as the tensor "
                                 f"{tensor.name!r} (llama3 / longrope RoPE); {HINT}")
        scaling = field(reader, f"{arch}.rope.scaling.type")
        if scaling not in (None, "none"):
            raise ValueError(f"{where}: {arch}.rope.scaling.type = {scaling!r}; {HINT}")
    stated = field(reader, f"{arch}.attention.sliding_window")
    if stated and window(config) != stated:
        raise ValueError(f"{where}: {arch}.attention.sliding_window = {stated} read back as "
                         f"{window(config)}; {HINT}")
    key_length = field(reader, f"{arch}.attention.key_length")
    if key_length and key_length != head_dim(config):
        raise ValueError(f"{where}: {arch}.attention.key_length = {key_length} (head_dim) read "
                         f"back as {head_dim(config)}; {HINT}")
    rotary = field(reader, f"{arch}.rope.dimension_count")
    factor = getattr(config, "partial_rotary_factor", None) or \
        (getattr(config, "rope_parameters", None) or {}).get("partial_rotary_factor", 1.0)
    if rotary and rotary != int(head_dim(config) * factor):
        raise ValueError(f"{where}: {arch}.rope.dimension_count = {rotary} (the rotary dims) "
                         f"read back as {int(head_dim(config) * factor)}; {HINT}")
