"""The memory plan (runtime/memory.py) against the RSS an engine really takes: load it as
`serve` does (the cache reserved), then fill every slot with a prompt of max_len - 64 tokens
and decode a few tokens with each method given, and print the plan's total beside the RSS over
the runtime's libraries once loaded and at its peak (docs/serving.md, "Memory").

    python scripts/memory_rss.py --engine engines/smollm2-135m --max-num-seqs 8 \\
        --max-model-len 2048 --methods none,eagle3,mtp
"""

from __future__ import annotations

import argparse
import resource

import numpy  # noqa: F401 - the runtime's libraries, loaded before the baseline
import onnxruntime  # noqa: F401
import tokenizers  # noqa: F401

from trt_spec.runtime.generator import Generator
from trt_spec.runtime.memory import size
from trt_spec.runtime.sampling import SamplingParams
from trt_spec.runtime.scheduler import generate_ids


def rss() -> int:
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engine", required=True)
    ap.add_argument("--max-num-seqs", type=int, default=8)
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--methods", default="none", help="comma-separated, run one after another")
    args = ap.parse_args()
    base = rss()
    gen = Generator(args.engine, max_batch=args.max_num_seqs, max_len=args.max_model_len)
    gen.cache.reserve()
    loaded = rss() - base
    vocab = gen.config.vocab_size
    prompts = [[(7 * i + j) % (vocab - 100) + 100 for j in range(args.max_model_len - 64)]
               for i in range(args.max_num_seqs)]
    for method in args.methods.split(","):
        generate_ids(gen, prompts, SamplingParams(max_tokens=8, ignore_eos=True), method,
                     None if method == "none" else 3)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base
    plan = gen.memory
    print("\n".join(plan.table(gen.memory_available)))
    print(f"RSS over the libraries: {size(loaded)} loaded (cache reserved), {size(peak)} at "
          f"peak: {peak / plan.total:.2f}x the plan's total")


if __name__ == "__main__":
    main()
