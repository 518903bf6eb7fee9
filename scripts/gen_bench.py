"""The answer generators side by side on one multi-turn workload: the torch generator
(train/batch_generate.py, in --dtype) against the engine's ONNX Runtime graphs
(train/engine_target.py), at several slot counts, interleaved in one process.

Each run answers the same training conversations the way `--answers distill` does (every
human turn, a greedy and --samples sampled variants, a conversation's next turn in its slot)
for --seconds from a cold start (prefill included) and reports tokens generated per second.
The shards it writes go to a temporary folder and are thrown away.

    python scripts/gen_bench.py --engine engines/smollm2-135m --slots 16,32,64 --seconds 75
"""

from __future__ import annotations

import argparse
import json
import platform
import tempfile
import time
from dataclasses import replace
from pathlib import Path


class Stop(Exception):
    pass


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                flags = Path("/proc/cpuinfo").read_text()
                amx = " (AMX)" if "amx_bf16" in flags else ""
                return line.split(":", 1)[1].strip() + amx
    except OSError:
        pass
    return platform.processor() or "unknown"


def one_run(make, conversations, tokenizer, config, stop_ids, seconds: float) -> dict:
    from trt_spec.train.batch_generate import GenStats
    from trt_spec.train.distill_data import ShardFeeder

    generator = make()
    stats = GenStats()
    with tempfile.TemporaryDirectory() as tmp:
        feeder = ShardFeeder(tokenizer, conversations, list(range(len(conversations) // 32 + 1)),
                             Path(tmp), config, lambda shard, tokens: None)

        def tick(s):
            if s.seconds >= seconds:
                raise Stop

        try:
            generator.run(feeder, set(stop_ids), feeder.on_answer, stats, tick=tick,
                          tick_seconds=1.0, on_dropped=feeder.on_dropped)
        except Stop:
            pass
    occupancy = sum(n * k for n, k in stats.by_batch.items()) / max(1, stats.steps)
    return {"tokens": stats.new_tokens, "prompt_tokens": stats.prompt_tokens,
            "seconds": round(stats.seconds, 1), "tokens_per_s": round(stats.tokens_per_s, 1),
            "mean_rows": round(occupancy, 1), "steps": stats.steps}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engine", required=True, help="engine folder (trt-spec export)")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--slots", default="16,32,64", help="slot counts, comma-separated")
    ap.add_argument("--backends", default="torch,engine")
    ap.add_argument("--dtype", default="bfloat16", help="the torch generator's")
    ap.add_argument("--seconds", type=float, default=75.0, help="each run's length")
    ap.add_argument("--conversations", type=int, default=256)
    ap.add_argument("--samples", type=int, default=1)
    ap.add_argument("--answer-tokens", type=int, default=256)
    ap.add_argument("--max-len", type=int, default=1024)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    import torch

    from trt_spec.export.checkpoint import load_target, resolve_model
    from trt_spec.export.sharegpt import fetch_sharegpt, load_tokenizer, read_conversations, split
    from trt_spec.train.batch_generate import BatchedGenerator
    from trt_spec.train.configs import DistillConfig
    from trt_spec.train.engine_target import EngineGenerator, EngineTarget

    hf_dir = resolve_model(args.model)
    target, _ = load_target(hf_dir)
    tokenizer = load_tokenizer(hf_dir)
    engine = EngineTarget(args.engine)
    engine.check_model(target.config)
    train, _ = split(read_conversations(fetch_sharegpt())[0])
    conversations = train[:args.conversations]
    config = DistillConfig(samples=args.samples, max_new_tokens=args.answer_tokens,
                           max_context=args.max_len)
    stop_ids = list(target.config.eos_token_ids) + (
        [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else [])
    makers = {
        "torch": lambda n: BatchedGenerator(target, n, args.max_len, "cpu",
                                            getattr(torch, args.dtype), config.seed),
        "engine": lambda n: EngineGenerator(engine, n, args.max_len, config.seed),
    }
    rows = []
    print(f"CPU: {cpu_name()}, {torch.get_num_threads()} threads; engine {args.engine}; "
          f"{args.seconds:.0f} s a run", flush=True)
    for n in [int(x) for x in args.slots.split(",")]:
        for backend in args.backends.split(","):
            r = one_run(lambda: makers[backend](n), conversations, tokenizer,
                        replace(config, slots=n), stop_ids, args.seconds)
            r.update(backend=backend if backend == "engine" else f"torch {args.dtype}", slots=n)
            rows.append(r)
            print(f"{r['backend']:>16} slots {n:3d}: {r['tokens_per_s']:7.1f} tokens/s "
                  f"({r['tokens']} tokens, {r['prompt_tokens']} prompt tokens read, "
                  f"mean rows {r['mean_rows']}, {r['seconds']} s)", flush=True)
    by = {(r["backend"].split()[0], r["slots"]): r["tokens_per_s"] for r in rows}
    for n in sorted({r["slots"] for r in rows}):
        if ("torch", n) in by and ("engine", n) in by:
            print(f"slots {n}: engine / torch = {by[('engine', n)] / by[('torch', n)]:.2f}x")
    if args.json:
        Path(args.json).write_text(json.dumps({"cpu": cpu_name(), "date": time.strftime("%Y-%m-%d"),
                                               "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
