"""The suffix lookup's length learning before and after it kept measuring (a prior at the
first position, one position more now and then, no second cut by position at k auto), side
by side in one process (docs/benchmarks.md, "Lookup lengths that keep learning").

    .venv/bin/python scripts/lookup_learning.py --engine engines/lean-int4-plain -k 4

Two generators of one engine, each learning on its own (engine-wide acceptance, as a server
would); "before" has the old rules put back. The held-out prompts are decoded greedily under
fast decoding and the gain rules, each prompt by both in turn (the order alternates, ABBA),
a fresh suffix cache per round; per round, tokens/s of each and the median over prompts of
the per-prompt speed ratio after / before. Two sessions of one graph differ by a few percent
(where their memory landed): --swap gives "before" the generator made second; run both ways.
Then each side's acceptance by source, as the engine measured it.
"""

from __future__ import annotations

import argparse
import time
import types

import numpy as np

from trt_spec.runtime.generator import Generator
from trt_spec.runtime.methods import traits
from trt_spec.runtime.proposers.suffix import SuffixCache
from trt_spec.runtime.sampling import SamplingParams
from trt_spec.runtime.scheduler import generate_ids
from trt_spec.runtime.speculation import draft_length as dl
from trt_spec.runtime.speculation import planner as planner_module
from trt_spec.tools.bench import load_prompts


class Before(dl.PositionAcceptance):
    """The rules before: no prior at the first position (one rejection reads 0), an unverified
    position read 0.8^(j + 1), and a cut draft never verified one position more."""

    def rate(self, j: int) -> float:
        if j >= len(self.proposed) or (j == 0 and self.proposed[0] < 1):
            return dl.PRIOR_ACCEPTANCE ** (j + 1)
        if j == 0:
            return self.accepted[0] / self.proposed[0]
        before = self.rate(j - 1)
        rate = ((self.accepted[j] + dl.PRIOR_COUNT * before * dl.PRIOR_ACCEPTANCE)
                / (self.proposed[j] + dl.PRIOR_COUNT))
        return min(rate, before)

    def longer(self, best: int, n: int) -> int:
        return best


def put_back(gen: Generator) -> None:
    """gen's engine with the rules before: Before acceptances, and the planner cutting a
    picking proposer's lookup drafts by position again at k auto."""
    rule = gen.engine.planner.draft_length
    rule.acceptance = types.MethodType(
        lambda self, name, sampled: self.positions.setdefault((name, sampled), Before()), rule)
    planner = gen.engine.planner
    draft_group = type(planner).draft_group

    def cut_again(self, method, group, ks, batch):
        real = planner_module.traits
        planner_module.traits = lambda m: (types.SimpleNamespace(
            **{**vars(real(m)), "picks_length": False}) if m == method else real(m))
        try:
            return draft_group(self, method, group, ks, batch)
        finally:
            planner_module.traits = real

    planner.draft_group = types.MethodType(cut_again, planner)


def acceptance(gen: Generator, method: str) -> str:
    rows = []
    for (name, sampled), acc in sorted(gen.engine.planner.draft_length.positions.items()):
        if name.startswith(method + ":") and not sampled and acc.proposed:
            rates = " ".join(f"{acc.rate(j):.2f}" for j in range(len(acc.proposed)))
            rows.append(f"    {name:12s} verified {acc.proposed[0]:5.1f}  P(d1..dj) {rates}")
    return "\n".join(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--engine", default="engines/lean-int4-plain")
    ap.add_argument("--prompts", default="runtime/data/sharegpt-heldout.jsonl")
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--method", default="suffix", help="a method that picks its length")
    ap.add_argument("-k", default="4", help="the most a step drafts, or auto")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--swap", action="store_true", help="'before' on the generator made second")
    args = ap.parse_args()
    if not traits(args.method).picks_length:
        raise SystemExit(f"--method {args.method!r}: not a method that picks its length")
    k = None if args.k == "auto" else int(args.k)
    made = [Generator(args.engine, max_batch=1, max_len=4096, threads=2, prefix_cache=False,
                      exact_decode=False) for _ in range(2)]
    sides = dict(zip(("after", "before") if args.swap else ("before", "after"), made))
    put_back(sides["before"])
    params = SamplingParams(max_tokens=args.max_new_tokens, temperature=0.0, ignore_eos=True)
    prompts = [made[0].encode(p) for p in load_prompts(args.prompts)[:args.num_prompts]]
    for gen in made:  # warm-up; what it wrote is not a request
        generate_ids(gen, prompts[:1], params, args.method, k)
    wall, tokens, ratios = dict.fromkeys(sides, 0.0), dict.fromkeys(sides, 0), []
    for r in range(args.rounds):
        for gen in made:
            gen.use_suffix_cache(SuffixCache())
        for i, ids in enumerate(prompts):
            took = {}
            for side in ("before", "after") if (i + r) % 2 == 0 else ("after", "before"):
                t0 = time.perf_counter()
                (s,) = generate_ids(sides[side], [ids], params, args.method, k)
                took[side] = time.perf_counter() - t0
                wall[side] += took[side]
                tokens[side] += len(s.output_ids)
            ratios.append(took["before"] / took["after"])
        print(f"round {r + 1}: before {tokens['before'] / wall['before']:.1f} tok/s, after "
              f"{tokens['after'] / wall['after']:.1f}; after / before, median of prompts "
              f"{np.median(ratios):.3f} (mean {np.mean(ratios):.3f})", flush=True)
    for side, gen in sides.items():
        print(f"  {side}: acceptance by source\n{acceptance(gen, args.method)}")


if __name__ == "__main__":
    main()
