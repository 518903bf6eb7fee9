#!/usr/bin/env python3
"""The device loop against the host loop on one torch device, side by side in one process:
tokens/s, tau and the outputs' agreement, per method and batch (what `--backend torch-cuda`
runs, with executor device and host).

    python scripts/device_loop_cpu.py --engine engines/smollm2-135m-fp32 [--device cpu]
        [--methods none,ngram,eagle3] [--batches 1,8] [--new-tokens 32] [--k 4] [--json OUT]

On the CPU this shows the host work the device loop removes (NumPy inputs, logits copied
back, NumPy verification), not GPU speed; `make gpu-check` measures the GPU.
"""

from __future__ import annotations

import argparse
import json
import sys
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--engine", required=True)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--methods", default="none,ngram,eagle3")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--max-len", type=int, default=512)
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    ap.add_argument("--repeats", type=int, default=3,
                    help="timed runs per (method, loop), interleaved; median and best reported")
    ap.add_argument("--fast-decode", action="store_true",
                    help="both loops without exact decoding (device: k + 1 rows a step)")
    ap.add_argument("--keep-denormals", action="store_true",
                    help="leave denormal floats on (by default both loops run with "
                         "torch.set_flush_denormal(True): CPU kernels slow down on them)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    import torch

    from trt_spec.runtime.generator import Generator
    from trt_spec.runtime.scheduler import generate_ids
    from trt_spec.runtime.sampling import SamplingParams
    from trt_spec.tools.bench import load_prompts

    torch.set_flush_denormal(not args.keep_denormals)
    if args.threads:
        torch.set_num_threads(args.threads)
    batches = [int(b) for b in args.batches.split(",")]
    gen = Generator(args.engine, backend="torch-cuda", device=args.device,
                    max_batch=max(batches), max_len=args.max_len, exact_decode=not args.fast_decode,
                    cuda_graphs=args.device != "cpu")
    prompts = [gen.encode(p) for p in load_prompts(None)]
    params = SamplingParams(max_tokens=args.new_tokens, ignore_eos=True)
    rows = []
    for batch in batches:
        ids = [prompts[i % len(prompts)] for i in range(batch)]
        outputs = {}
        for method in args.methods.split(","):
            k = None if method == "none" else args.k
            times = {True: [], False: []}
            for _ in range(args.repeats):
                for loop in (True, False):  # interleaved: device, then host, per method
                    gen.configure(executor="device" if loop else "host")
                    generate_ids(gen, ids, SamplingParams(max_tokens=4, ignore_eos=True), method, k)
                    if args.device != "cpu":
                        torch.cuda.synchronize()
                    t = time.perf_counter()
                    streams = generate_ids(gen, ids, params, method, k)
                    if args.device != "cpu":
                        torch.cuda.synchronize()
                    times[loop].append((time.perf_counter() - t, streams))
            for loop in (True, False):
                runs = sorted(times[loop], key=lambda x: x[0])
                streams = runs[0][1]
                tokens = sum(len(s.output_ids) for s in streams)
                forwards = sum(s.stats.target_forwards for s in streams)
                outputs[(method, loop)] = [s.output_ids for s in streams]
                row = {"batch": batch, "method": method, "loop": "device" if loop else "host",
                       "tokens_per_s_median": round(tokens / runs[len(runs) // 2][0], 1),
                       "tokens_per_s_best": round(tokens / runs[0][0], 1),
                       "tau": round(tokens / forwards, 2),
                       "best_run_propose_score_sample_s": [
                           round(sum(getattr(s.stats, f) for s in streams), 3)
                           for f in ("propose_s", "score_s", "sample_s")]}
                rows.append(row)
                print(json.dumps(row), flush=True)
        plain = outputs.get(("none", False))
        for (method, loop), outs in outputs.items():
            same = sum(a == b for a, b in zip(outs, plain)) if plain else None
            print(f"batch {batch} {method} {'device' if loop else 'host'}: "
                  f"{same}/{len(outs)} outputs equal to the host loop's plain greedy", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rows": rows, "torch": torch.__version__,
                       "threads": torch.get_num_threads()}, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
