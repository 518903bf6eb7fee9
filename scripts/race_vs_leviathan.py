"""The host loop's sampling rule against Leviathan's, side by side in one process.

The host loop samples with the exponential race (runtime/race.py, runtime/verify.py): a seed
gives the same tokens under every method and k. Leviathan et al.'s rule (accept a draft x with
probability min(1, p(x) / q(x)), else draw from norm(max(0, p - q)), one sequential random
stream per request) is what it replaced; it is still in runtime/verify.py as
`stochastic_verify`. This script puts it back for the length of a `with leviathan():` block,
as the host loop ran it before the race (main at 75f2aac): a drafter draws its draft from q
with the request's own stream, the target's token after a mismatch, the bonus and a plain
step are drawn from that stream too. Nothing else changes: the same engine, policy and
drafters.

It runs `trt-spec bench` (tools/bench.py run_bench) under each rule in turn, passes
alternating (race, Leviathan, Leviathan, race, ...), and reports per method and k: the
acceptance (accepted / drafted), the first position's, tau and the median decode tokens/s,
and their ratios race / Leviathan.

    python scripts/race_vs_leviathan.py --methods mtp,eagle3,vanilla --num-draft-tokens 4 \
        --temperature 0.8 --top-p 0.95 --num-prompts 16 --max-new-tokens 96 \
        --no-spec-fallback --passes 1 --json race-vs-leviathan.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
from dataclasses import replace

import numpy as np

from trt_spec.runtime import engine as engine_module
from trt_spec.runtime import stream_step
from trt_spec.runtime.proposers import base as proposers_base
from trt_spec.runtime.sampling import sample_from_probs, target_probs
from trt_spec.runtime.speculation.planner import Verified
from trt_spec.runtime.stream import controlled
from trt_spec.tools.bench import run_bench
from trt_spec.tools.bench_config import BenchConfig

RULES = ("race", "leviathan")


class Streams:
    """One numpy Generator per request, seeded with its seed (as Stream.rng was), kept by the
    identity of its SamplingParams (each stream holds its own; the entry keeps the object alive,
    so its id is not reused)."""

    def __init__(self):
        self.rngs: dict[int, tuple[object, np.random.Generator]] = {}

    def __call__(self, params) -> np.random.Generator:
        entry = self.rngs.get(id(params))
        if entry is None:
            entry = self.rngs[id(params)] = (params, np.random.default_rng(params.seed))
        return entry[1]


@contextlib.contextmanager
def leviathan():
    """The host loop under Leviathan's rule for the length of the block."""
    from trt_spec.runtime.verify import stochastic_verify

    rng = Streams()

    def draw(s, q, drafted) -> int:  # proposers/base.py: the draft drawn from q
        return sample_from_probs(q, rng(s.params))

    def next_token(logits, params, position) -> int:  # a plain step, the first token
        if params.greedy:
            return int(np.argmax(logits))
        return sample_from_probs(target_probs(logits, params), rng(params))

    def verify_stream(s, d, logits) -> Verified:  # stream_step.verify_stream's, Leviathan's
        if s.fault is not None:
            raise s.fault
        if not len(d):
            return Verified(0, 0, [next_token(controlled(s, logits[-1:])[0], s.params, 0)])
        rows = controlled(s, logits, d.tokens)
        if s.params.greedy:
            from trt_spec.runtime.verify import greedy_verify
            a, out = greedy_verify(np.asarray(d.tokens), rows)
        else:
            a, out = stochastic_verify(np.asarray(d.tokens), d.q, rows, s.params, rng(s.params))
        return Verified(len(d), a, out)

    saved = (proposers_base.draw, engine_module.next_token, engine_module.verify_stream)
    proposers_base.draw = draw
    engine_module.next_token = next_token
    engine_module.verify_stream = verify_stream
    try:
        yield
    finally:
        proposers_base.draw, engine_module.next_token, engine_module.verify_stream = saved


def under(rule: str, config: BenchConfig, progress) -> dict:
    with leviathan() if rule == "leviathan" else contextlib.nullcontext():
        return run_bench(config, progress)


def label(r: dict) -> str:
    return r["method"] if r["num_draft_tokens"] is None else \
        f"{r['method']} k={r['num_draft_tokens']}"


def combine(reports: dict[str, list[dict]]) -> list[dict]:
    """Per configuration: each rule's acceptance, first position's, tau, tokens/s (median over
    every run of every pass), pooled over the passes."""
    rows = {}
    for rule, passes in reports.items():
        for report in passes:
            for r in report["results"]:
                if r["workload"] != "prompts" or r.get("peer"):
                    continue
                row = rows.setdefault(label(r), {"config": label(r)})
                acc = row.setdefault(rule, {"drafted": 0, "accepted": 0, "drafted_1st": 0,
                                            "accepted_1st": 0, "tau": [], "tokens_per_s": [],
                                            "same": []})
                drafted = r["drafted_per_position"]
                accepted = [a * d for a, d in zip(r["acceptance_per_position"], drafted)]
                acc["drafted"] += sum(drafted)
                acc["accepted"] += round(sum(accepted))
                acc["drafted_1st"] += drafted[0] if drafted else 0
                acc["accepted_1st"] += round(accepted[0]) if accepted else 0
                acc["tau"].append(r["tau"])
                acc["tokens_per_s"] += r["tokens_per_s"]["runs"]
                if r["identical_to_baseline"] is not None:  # seeded: the share equal to none's
                    acc["same"].append(r["identical_to_baseline"])
    out = []
    for row in rows.values():
        for rule in RULES:
            a = row.get(rule)
            if a is None:
                continue
            a["acceptance"] = a["accepted"] / a["drafted"] if a["drafted"] else None
            a["acceptance_1st"] = a["accepted_1st"] / a["drafted_1st"] if a["drafted_1st"] \
                else None
            a["tau"] = statistics.mean(a["tau"])
            a["tokens_per_s"] = statistics.median(a["tokens_per_s"])
            a["same"] = statistics.mean(a["same"]) if a["same"] else None
        if all(rule in row for rule in RULES):
            race, lev = row["race"], row["leviathan"]
            row["ratio"] = {
                "acceptance": (race["acceptance"] / lev["acceptance"]
                               if race["acceptance"] and lev["acceptance"] else None),
                "tokens_per_s": race["tokens_per_s"] / lev["tokens_per_s"]}
        out.append(row)
    return out


def table(rows: list[dict]) -> str:
    def f(x, fmt):
        return "-" if x is None else format(x, fmt)

    lines = ["| config | race acc | Leviathan acc | ratio | race 1st | Leviathan 1st "
             "| race tau | Leviathan tau | race tok/s | Leviathan tok/s | ratio | race same "
             "| Leviathan same |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        r, lv, ratio = row["race"], row["leviathan"], row["ratio"]
        lines.append(
            f"| {row['config']} | {f(r['acceptance'], '.3f')} | {f(lv['acceptance'], '.3f')} "
            f"| {f(ratio['acceptance'], '.2f')} | {f(r['acceptance_1st'], '.3f')} "
            f"| {f(lv['acceptance_1st'], '.3f')} | {r['tau']:.2f} | {lv['tau']:.2f} "
            f"| {r['tokens_per_s']:.1f} | {lv['tokens_per_s']:.1f} "
            f"| {ratio['tokens_per_s']:.3f} | {f(r['same'], '.2f')} | {f(lv['same'], '.2f')} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engine", default="engines/smollm2-135m")
    ap.add_argument("--prompts", default="runtime/data/sharegpt-heldout.jsonl")
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--methods", default="mtp,eagle3,vanilla")
    ap.add_argument("--num-draft-tokens", default="4", help="comma-separated ks")
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--temperature", type=float, default=0.8)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--passes", type=int, default=1, help="passes per rule, alternating")
    ap.add_argument("--spec-fallback", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    ks = tuple(int(k) if k.isdigit() else k for k in a.num_draft_tokens.split(","))
    config = BenchConfig(engines=(a.engine,), methods=tuple(a.methods.split(",")), ks=ks,
                         max_new_tokens=a.max_new_tokens, prompts_file=a.prompts,
                         num_prompts=a.num_prompts, repeats=1, temperature=a.temperature,
                         top_p=a.top_p, seed=a.seed, threads=a.threads,
                         fallback=a.spec_fallback)
    reports: dict[str, list[dict]] = {rule: [] for rule in RULES}
    for i in range(a.passes):
        order = RULES if i % 2 == 0 else RULES[::-1]  # race, lev, lev, race, ...
        for rule in order:
            print(f"pass {i + 1}/{a.passes}: {rule}", flush=True)
            reports[rule].append(under(rule, replace(config), lambda m: None))
    rows = combine(reports)
    print(table(rows))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"settings": vars(a), "machine": reports["race"][0]["machine"],
                       "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
