"""The Python around a decode step, with and without the two lean paths of a verification
(docs/quantization.md, "The lean graph", lever 4), old and new interleaved in one process.

    .venv/bin/python scripts/step_python.py --engine engines/lean-int4-plain --method suffix

Per round, the same held-out prompts decoded greedily under fast decoding, k fixed (every
step drafts), a fresh suffix cache each run: the wall time less the target session's
(`run_with_iobinding`), per session run. "before" puts back what a step did before: the
finiteness check over every row then every row's argmax (for greedy_verify's one pass up to
the first mismatch), and the general `step` (decode_rows declines).
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

from trt_spec.runtime import stream_step
from trt_spec.runtime.generator import Generator
from trt_spec.runtime.proposers.suffix import SuffixCache
from trt_spec.runtime.sampling import SamplingParams, check_finite
from trt_spec.runtime.scheduler import generate_ids


def two_pass(drafts, logits):
    """Greedy verification as it was: every row checked, then every row's argmax."""
    target = check_finite(logits, "logits").argmax(-1)
    k = len(drafts)
    mismatch = np.nonzero(np.asarray(drafts) != target[:k])[0]
    a = int(mismatch[0]) if mismatch.size else k
    return a, [int(t) for t in drafts[:a]] + [int(target[a])]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--engine", default="engines/lean-int4-plain")
    ap.add_argument("--prompts", default="runtime/data/sharegpt-heldout.jsonl")
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--method", default="suffix")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    gen = Generator(args.engine, max_batch=1, max_len=1024, threads=2, prefix_cache=False,
                    exact_decode=False, fallback=False)
    with open(args.prompts) as f:  # each line's first message, its first 200 tokens
        lines = [json.loads(line) for line in f if line.strip()][:args.num_prompts]
    ids = [gen.tokenizer.encode(p["messages"][0]["content"])[:200] for p in lines]
    params = SamplingParams(max_tokens=args.max_new_tokens, temperature=0.0, ignore_eos=True)
    k = None if args.method == "none" else args.k
    target, session = gen.target, gen.target.session
    spent = [0.0, 0]
    run = session.run_with_iobinding

    def timed(*a, **kw):
        t0 = time.perf_counter()
        out = run(*a, **kw)
        spent[0] += time.perf_counter() - t0
        spent[1] += 1
        return out

    session.run_with_iobinding = timed
    sides = {"after": (stream_step.greedy_verify, target.decode_rows),
             "before": (two_pass, lambda *a, **kw: None)}
    generate_ids(gen, ids[:1], params, args.method, k)  # warm-up
    outputs = {}
    for r in range(args.rounds):
        for side, (verify, rows) in sides.items():
            stream_step.greedy_verify, target.decode_rows = verify, rows
            gen.use_suffix_cache(SuffixCache())
            spent[:] = [0.0, 0]
            t0 = time.perf_counter()
            streams = generate_ids(gen, ids, params, args.method, k)
            wall = time.perf_counter() - t0
            outputs.setdefault(side, [s.output_ids for s in streams])
            print(f"round {r + 1} {side:6s}: Python {1e6 * (wall - spent[0]) / spent[1]:.0f} us "
                  f"a session run ({spent[1]} runs), wall {wall:.2f} s", flush=True)
    print("outputs the same:", outputs["after"] == outputs["before"])


if __name__ == "__main__":
    main()
