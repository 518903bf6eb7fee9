#!/usr/bin/env python3
"""Greedy reference for scripts/gpu_check.py, computed on the CPU with the ORT fp32 engine.

    python scripts/gpu_reference.py --model MODEL --out gpu-reference.json \
        [--engine FP32_ENGINE_DIR] [--prompts 8] [--max-new-tokens 64]

MODEL: what export/checkpoint.py resolve_model takes (a name, a .gguf, a HF folder). Without
--engine an fp32 target-only engine is exported to a temporary folder first. The JSON holds,
per prompt, its token ids (chat template applied when the model has one) and the greedy
continuation; gpu_check compares against it by teacher forcing.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path


def reference(engine: Path, model: str, prompts: list, max_new_tokens: int) -> dict:
    from trt_spec.runtime.generator import Generator
    from trt_spec.runtime.scheduler import generate_ids
    from trt_spec.runtime.sampling import SamplingParams

    gen = Generator(engine, max_batch=1, max_len=2048)
    precision = gen.manifest.graph("target")["precision"]
    if precision != "fp32":
        raise SystemExit(f"{engine}: the reference needs an fp32 engine, this one is {precision}")
    ids = [gen.encode(p) for p in prompts]
    params = SamplingParams(max_tokens=max_new_tokens, ignore_eos=True)
    streams = generate_ids(gen, ids, params)
    c = gen.config
    return {
        "model": model,
        "backend": "ort", "precision": precision, "greedy": True,
        "config": {"vocab_size": c.vocab_size, "hidden_size": c.hidden_size,
                   "num_layers": c.num_layers},
        "max_new_tokens": max_new_tokens,
        "items": [{"prompt": p, "prompt_ids": i, "output_ids": s.output_ids}
                  for p, i, s in zip(prompts, ids, streams)],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--engine", default=None, help="an existing fp32 engine folder of MODEL")
    ap.add_argument("--out", required=True)
    ap.add_argument("--prompts", type=int, default=8, help="how many of the shipped prompts")
    ap.add_argument("--prompts-file", default=None, help="JSONL prompts (bench's format)")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    args = ap.parse_args()

    from trt_spec.tools.bench import load_prompts

    prompts = load_prompts(args.prompts_file)[:args.prompts]
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        engine = Path(args.engine) if args.engine else None
        if engine is None:
            from trt_spec.export.config import ExportConfig
            from trt_spec.export.pipeline import export_model

            engine = export_model(ExportConfig(args.model, Path(tmp) / "fp32", "fp32",
                                               shipped_drafters=False))
        ref = reference(engine, args.model, prompts, args.max_new_tokens)
    Path(args.out).write_text(json.dumps(ref, indent=1) + "\n")
    print(f"wrote {args.out}: {len(ref['items'])} prompts x {args.max_new_tokens} tokens "
          f"in {time.perf_counter() - t0:.0f} s", file=sys.stderr)


if __name__ == "__main__":
    main()
