"""The architecture x RoPE kind table of docs/families.md: for each tiny model of
tests/rope_models.py (a published config shrunk), the max |logit difference| to transformers
and the greedy (argmax) agreement over 64 positions that cross the model's RoPE threshold,
per backend: the torch export module, the exported ORT graph in fp32 and in int4; and per
checkpoint form: the same model quantized to 4 bits (round to nearest, group 16) and written
in the GPTQ and the AWQ layouts, exported (int4, the checkpoint's codes as they are) and
compared with transformers running the checkpoint's dequantized weights; and the model written
as an F32 GGUF the way llama.cpp does (tests/gguf_models.py), exported from the .gguf (fp32)
and compared with transformers loading that .gguf. A form the exporter refuses gets the
refusal's first words in its cell; a GGUF transformers' reader does not give back whole (a
config field it loses, or a load it fails) gets what it loses.

    .venv/bin/python scripts/families_table.py [--models llama3.1 phi4-mini ...]

The reference is transformers decoding one token per call with a KV cache (the rule the
length-dependent kinds follow, export/rope.py), from a random prompt that ends 8 tokens before
the threshold; each backend is teacher-forced along transformers' greedy continuation and
"agree" is the share of the 64 positions where its argmax is transformers' (trt-spec
fidelity's greedy agreement). "one-shot Δ" is the torch module's max |logit difference|
past the threshold to transformers' one-shot forward over the whole sequence: 0 up to float
error for the static kinds; the documented difference for longrope and dynamic NTK.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.rope_models import (MODELS, NAMES, VOCAB, cached_logits, greedy_cached,  # noqa: E402
                               hf_model, make_hf)

POSITIONS = 64


def torch_logits(model, config, ids: list[int], prefill: int) -> np.ndarray:
    """The export module: a prefill, then one token per step -> logits [len(ids), V]."""
    import torch

    from trt_spec.export.model import empty_cache

    past = empty_cache(config, 1, len(ids))
    out, start = [], 0
    with torch.no_grad():
        for n in [prefill] + [1] * (len(ids) - prefill):
            total = start + n
            logits, _, _, *past = model(
                torch.tensor([ids[start:total]]), torch.arange(start, total)[None],
                torch.tensor([total - 1], dtype=torch.int32),
                torch.tensor([n], dtype=torch.int32), torch.tensor(len(ids), dtype=torch.int32),
                torch.arange(n)[None], *past)
            out.append(logits[0].numpy())
            start = total
    return np.concatenate(out)


def ort_logits(engine: Path, config, ids: list[int], prefill: int) -> np.ndarray:
    from trt_spec.runtime.backends.ort import OrtTarget
    from trt_spec.runtime.kv_cache import KVCache
    from trt_spec.runtime.step_inputs import SlotTokens

    target = OrtTarget(engine / "target.onnx", config.num_layers, config.max_position_embeddings)
    cache = KVCache(config, slots=1, max_len=len(ids))
    slot, out, start = cache.allocate(), [], 0
    for n in [prefill] + [1] * (len(ids) - prefill):
        step = target.step(cache, [SlotTokens(slot, ids[start:start + n], list(range(n)))])
        out.append(np.asarray(step.logits[0][:n], np.float32))
        start += n
    return np.concatenate(out)


GROUP = 16  # the tiny models' widths are multiples of 16


def dequantized_hf(folder: Path, codes: dict, config):
    """transformers' model of `folder` with each quantized module's weight replaced by the
    codes' dequantized values (what a GPTQ / AWQ kernel computes with)."""
    import torch

    from trt_spec.export.gptq_quantize import module_sizes, split
    from trt_spec.export.int4_checkpoint import dequantize, parts_of

    model = hf_model(folder)
    sizes = module_sizes(config)
    with torch.no_grad():
        for name, ql in codes.items():
            i, fused = name.split(".")[1], name.split(".")[2]
            layer = model.get_submodule(f"model.layers.{i}")
            parts = parts_of(fused, lambda p: hasattr(layer.get_submodule(p.split(".")[0]),
                                                      p.split(".")[1]))
            pieces = split(ql, sizes[fused]) if len(parts) > 1 else [ql]
            for part, piece in zip(parts, pieces):
                model.get_submodule(f"model.layers.{i}.{part}").weight.copy_(dequantize(piece))
    return model


def quantized_cells(name: str, folder: Path, work: Path, ids: list[int],
                    prefill: int) -> dict:
    """{"GPTQ": cell, "AWQ": cell}: (max Δ, agree) or the refusal's text."""
    from trt_spec.export.checkpoint import load_target
    from trt_spec.export.config import ExportConfig
    from trt_spec.export.gptq_quantize import awq_config, gptq_config, quantize_target, write_folder
    from trt_spec.export.pipeline import export_model

    target, config = load_target(folder)
    codes = quantize_target(target, None, GROUP, progress=lambda msg: None)
    want = cached_logits(dequantized_hf(folder, codes, config), ids, prefill).numpy()[prefill:]
    cells = {}
    for form, qc in (("GPTQ", gptq_config(GROUP, False, False)), ("AWQ", awq_config(GROUP))):
        try:
            checkpoint = write_folder(folder, work / f"{name}-{form}", codes, config, qc)
            engine = export_model(ExportConfig(str(checkpoint), work / f"{name}-{form}-engine",
                                               "int4"))
        except (ValueError, KeyError, NotImplementedError) as e:
            cells[f"{form} int4"] = "refused: " + str(e).split(";")[0][:60]
            continue
        got = ort_logits(engine, config, ids, prefill)[prefill:]
        cells[f"{form} int4"] = (float(np.abs(got - want).max()),
                                 float((got.argmax(-1) == want.argmax(-1)).mean()))
    return cells


def lost_in_gguf(original, loaded) -> str | None:
    """What transformers' GGUF reader did not give back of `original`'s config (the first
    field that differs and changes the model), or None."""
    def rope(c):
        return (c.rope_parameters or {}).get("rope_type", "default")

    def window(c):
        w = getattr(c, "sliding_window", None)
        return w if w and getattr(c, "use_sliding_window", True) else None

    def head_dim(c):
        return getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads

    for field, get in (("head_dim", head_dim), ("rope_type", rope), ("sliding_window", window),
                       ("partial_rotary_factor",
                        lambda c: getattr(c, "partial_rotary_factor", None) or
                        (c.rope_parameters or {}).get("partial_rotary_factor", 1.0))):
        if get(original) != get(loaded):
            return f"{field} {get(original)} read back as {get(loaded)}"
    return None


def gguf_cell(name: str, folder: Path, work: Path, ids: list[int], prefill: int):
    """The model written as an F32 GGUF as llama.cpp would (tests/gguf_models.py), exported
    from the .gguf, against transformers loading the same .gguf: (max Δ, agree), or why
    transformers' GGUF reader cannot round-trip it."""
    import torch
    import transformers

    from tests.gguf_models import write_gguf
    from trt_spec.export.checkpoint import load_target, resolve_model
    from trt_spec.export.config import ExportConfig
    from trt_spec.export.pipeline import export_model

    gguf_dir = work / f"{name}-gguf"
    gguf_dir.mkdir()
    path = write_gguf(folder, gguf_dir / f"{name}.gguf", name)
    lost = lost_in_gguf(hf_model(folder).config,
                        transformers.AutoConfig.from_pretrained(gguf_dir, gguf_file=path.name))
    if lost is not None:
        return "refused: transformers' GGUF reader: " + lost
    try:
        reference = transformers.AutoModelForCausalLM.from_pretrained(
            gguf_dir, gguf_file=path.name, dtype=torch.float32).eval()
    except (ValueError, NotImplementedError) as e:
        return "refused: transformers' GGUF reader: " + str(e).split(" in gguf-py")[0][:70]
    engine = export_model(ExportConfig(str(path), work / f"{name}-gguf-engine", "fp32"))
    config = load_target(resolve_model(str(path)))[1]
    want = cached_logits(reference, ids, prefill).numpy()[prefill:]
    got = ort_logits(engine, config, ids, prefill)[prefill:]
    return float(np.abs(got - want).max()), float((got.argmax(-1) == want.argmax(-1)).mean())


def row(name: str, work: Path) -> dict:
    import torch

    from trt_spec.export.checkpoint import load_target
    from trt_spec.export.config import ExportConfig
    from trt_spec.export.pipeline import export_model

    folder = make_hf(work / name, name)
    model, config = load_target(folder)
    threshold = MODELS[name][3]
    prefill = max(1, min(threshold - 8, config.max_position_embeddings - POSITIONS))
    prompt = np.random.default_rng(0).integers(3, VOCAB, prefill).tolist()
    ids = prompt + greedy_cached(folder, prompt, POSITIONS)  # transformers' greedy path
    want = cached_logits(hf_model(folder), ids, prefill).numpy()[prefill:]
    with torch.no_grad():
        one_shot = hf_model(folder)(torch.tensor([ids])).logits[0].numpy()[prefill:]
    got = {"torch": torch_logits(model, config, ids, prefill)[prefill:]}
    for precision in ("fp32", "int4"):
        engine = export_model(ExportConfig(str(folder), work / f"{name}-{precision}", precision))
        got[f"ORT {precision}"] = ort_logits(engine, config, ids, prefill)[prefill:]
    past = slice(max(threshold - prefill, 0), None)
    cells = {k: (float(np.abs(v - want).max()), float((v.argmax(-1) == want.argmax(-1)).mean()))
             for k, v in got.items()}
    cells.update(quantized_cells(name, folder, work, ids, prefill))
    cells["GGUF fp32"] = gguf_cell(name, folder, work, ids, prefill)
    return {"name": name, "arch": MODELS[name][0], "kind": config.rope_scaling.kind,
            "rotary": f"{config.rotary_dim}/{config.head_dim}",
            "window": config.sliding_window,
            "cells": cells,
            "one_shot": float(np.abs(got["torch"][past] - one_shot[past]).max())}


def table(rows: list[dict]) -> str:
    backends = list(rows[0]["cells"])
    head = ("| model | architecture | RoPE | rotary / head dim | window | "
            + " | ".join(f"{b}: max Δ, agree" for b in backends) + " | one-shot Δ |")
    lines = [head, "|" + "---|" * (6 + len(backends))]
    for r in rows:
        cells = " | ".join(c if isinstance(c, str) else f"{c[0]:.1e}, {c[1]:.2f}"
                           for c in r["cells"].values())
        lines.append(f"| {r['name']} | {r['arch']} | {r['kind']} | {r['rotary']} | "
                     f"{r['window'] or '-'} | {cells} | {r['one_shot']:.1e} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="*", default=list(NAMES), choices=NAMES)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        os.environ["TRT_SPEC_CACHE"] = tmp  # the .gguf exports' folders, not the user's cache
        rows = [row(name, Path(tmp)) for name in args.models]
    print(table(rows))


if __name__ == "__main__":
    main()
