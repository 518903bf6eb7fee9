"""Our vanilla draft (project format) as a GGUF that llama.cpp loads as a draft model
(`llama-server -md FILE`), written with the `gguf` package.

The target's GGUF gives everything the draft shares with it: its metadata (the tokenizer
with its merges and chat template, the attention and RoPE settings) and its token embedding,
copied as stored (the draft's embedding and tied head are the target's). The draft's own
tensors (its layers and final norm, fp16 in the checkpoint) are written as F16, the norms as
F32. llama.cpp's Llama layout orders each attention head's q and k rows as interleaved RoPE
pairs where Hugging Face (and our model) keep the two halves apart: `to_gguf_rows` permutes
them.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from trt_spec.runtime.files import source_stamp
from trt_spec.runtime.methods import METHODS

DRAFT_KIND = METHODS["vanilla"].train_name  # drafter.json "kind" of a vanilla draft model

# our draft key (after "layers.N.") -> GGUF tensor name (after "blk.N.")
LAYER_TENSORS = {"input_layernorm": "attn_norm.weight", "post_attention_layernorm":
                 "ffn_norm.weight", "o_proj.weight": "attn_output.weight",
                 "down_proj.weight": "ffn_down.weight"}
SKIPPED_KEYS = ("GGUF.", "general.architecture", "general.file_type", "general.name",
                "llama.block_count")


def to_gguf_rows(weight: np.ndarray, heads: int) -> np.ndarray:
    """q or k rows [heads * head_dim, in], each head's halves (x0..x_{d/2-1}, y0..) ->
    pairs (x0, y0, x1, y1, ...), the order llama.cpp's RoPE reads."""
    rows, cols = weight.shape
    d = rows // heads
    return weight.reshape(heads, 2, d // 2, cols).swapaxes(1, 2).reshape(rows, cols)


def from_gguf_rows(weight: np.ndarray, heads: int) -> np.ndarray:
    """The inverse of to_gguf_rows."""
    rows, cols = weight.shape
    d = rows // heads
    return weight.reshape(heads, d // 2, 2, cols).swapaxes(1, 2).reshape(rows, cols)


def draft_tensors(state: dict[str, np.ndarray], config: dict) -> dict[str, np.ndarray]:
    """The draft checkpoint's tensors ({key: array} as saved: fused qkv_proj / gate_up_proj)
    -> {GGUF name: array} (F16 matrices, F32 norms)."""
    heads, kv_heads, head_dim = config["num_heads"], config["num_kv_heads"], config["head_dim"]
    q, kv, ffn = heads * head_dim, kv_heads * head_dim, config["intermediate_size"]
    out = {"output_norm.weight": state["norm"].astype(np.float32)}
    for i in range(config["num_layers"]):
        p, o = f"layers.{i}.", f"blk.{i}."
        for ours, theirs in LAYER_TENSORS.items():
            dtype = np.float32 if ours.endswith("layernorm") else np.float16
            out[o + theirs] = state[p + ours].astype(dtype)
        qkv = state[p + "qkv_proj.weight"]
        if qkv.shape[0] != q + 2 * kv:
            raise ValueError(f"draft layer {i}: qkv_proj has {qkv.shape[0]} rows, expected "
                             f"{q + 2 * kv} (heads {heads}, kv heads {kv_heads}, head_dim "
                             f"{head_dim})")
        out[o + "attn_q.weight"] = to_gguf_rows(qkv[:q], heads).astype(np.float16)
        out[o + "attn_k.weight"] = to_gguf_rows(qkv[q:q + kv], kv_heads).astype(np.float16)
        out[o + "attn_v.weight"] = qkv[q + kv:].astype(np.float16)
        gate_up = state[p + "gate_up_proj.weight"]
        out[o + "ffn_gate.weight"] = gate_up[:ffn].astype(np.float16)
        out[o + "ffn_up.weight"] = gate_up[ffn:].astype(np.float16)
    return out


def _field_value(field):
    import gguf

    value = field.contents()
    vtype = field.types[0]
    sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
    return value, vtype, sub


def draft_to_gguf(target_gguf: str | Path, draft_dir: str | Path, out: str | Path) -> Path:
    """Writes the draft in `draft_dir` as the GGUF `out` (to a temporary file, then renamed),
    or returns `out` untouched when it was made from the same target and draft (a stamp
    beside it says which)."""
    import gguf
    from safetensors.numpy import load_file

    target_gguf, draft_dir, out = Path(target_gguf), Path(draft_dir), Path(out)
    stamp = source_stamp(target_gguf, draft_dir)
    stamp_file = out.with_name(out.name + ".source.json")
    if out.is_file() and stamp_file.is_file() and json.loads(stamp_file.read_text()) == stamp:
        return out
    meta = json.loads((draft_dir / "drafter.json").read_text())
    if meta.get("kind") != DRAFT_KIND:
        raise ValueError(f"{draft_dir} holds a {meta.get('kind')!r} drafter, not a vanilla "
                         "draft model")
    config = meta["model_config"]
    if config.get("family", "llama") != "llama":
        raise ValueError(f"a {config['family']} draft cannot be written as a GGUF yet (only "
                         "the Llama layout)")
    reader = gguf.GGUFReader(target_gguf)
    arch = _field_value(reader.fields["general.architecture"])[0]
    if arch != "llama":
        raise ValueError(f"{target_gguf}: architecture {arch!r}; only llama is written")
    target_layers = _field_value(reader.fields["llama.block_count"])[0]
    if config["num_layers"] > target_layers:
        raise ValueError(f"the draft has {config['num_layers']} layers, the target "
                         f"{target_layers}")
    tensors = draft_tensors({k: v for k, v in load_file(draft_dir / "model.safetensors").items()},
                            config)
    embedding = next(t for t in reader.tensors if t.name == "token_embd.weight")

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    writer = gguf.GGUFWriter(tmp, "llama")
    try:
        for key, field in reader.fields.items():
            if key.startswith(SKIPPED_KEYS):
                continue
            value, vtype, sub = _field_value(field)
            writer.add_key_value(key, value, vtype, sub_type=sub)
        writer.add_name(f"{_field_value(reader.fields['general.name'])[0]} draft "
                        f"({config['num_layers']} layers, trt-spec)")
        writer.add_block_count(config["num_layers"])
        writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
        writer.add_tensor(embedding.name, np.asarray(embedding.data),
                          raw_dtype=embedding.tensor_type)
        for name, array in tensors.items():
            writer.add_tensor(name, np.ascontiguousarray(array))
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
    finally:
        writer.close()
    tmp.replace(out)
    stamp_file.write_text(json.dumps(stamp, indent=2) + "\n")
    return out
