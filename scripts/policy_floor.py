"""The gain rules' floor side by side: every method and k under the break-even rules (the
c(T) model alone) and under the stricter ones (drafting steps weighed by their measured wall
time, a margin over plain decoding), each against its own plain decoding, in one process:
per prompt each configuration runs under one rule set and at once under the other, and plain
decoding runs on both before and after every `--block` configurations, each configuration
counted against the plain runs around its block (a loaded machine's load drifts within
minutes: one plain run a prompt was a baseline at one moment).

    python scripts/policy_floor.py --engine engines/smollm2-135m \
        --prompts runtime/data/sharegpt-heldout.jsonl --num-prompts 8 --max-new-tokens 64 \
        --methods vanilla,mtp,eagle,eagle3 --ks 2,auto --threads 2

Prints one row per method and k: x plain (tau) under each rule set, the share of its decode
steps that ran as the lean plain step (a drafter switched off, or one that found nothing:
runtime/plain_step.py), and whether every output equals plain decoding's (greedy). Each rule
set has its own engine, so its measurements (acceptance, costs) are its own; a prompt's
json_schema (if any) is held as in the bench.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import time

from trt_spec.runtime.generator import Generator
from trt_spec.runtime.sampling import SamplingParams
from trt_spec.runtime.scheduler import generate_ids
from trt_spec.runtime.settings import SpeculationConfig
from trt_spec.tools.bench_prompts import load_prompts, load_schemas

RULES = {"before": SpeculationConfig(margin=0.0, measured_costs=False),  # the defaults
         "after": SpeculationConfig(margin=0.03, measured_costs=True)}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--engine", default="engines/smollm2-135m")
    p.add_argument("--prompts", default="runtime/data/sharegpt-heldout.jsonl")
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--methods", default="vanilla,mtp,eagle,eagle3")
    p.add_argument("--ks", default="2,auto")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--block", type=int, default=8,
                   help="configurations between two plain runs (each is judged against those)")
    p.add_argument("--json", default=None)
    return p.parse_args()


def count_lean(gen: Generator) -> list[int]:
    """Counts the target's lean plain steps (decode_one calls that ran) into the list's one
    element."""
    counter, one = [0], gen.target.decode_one

    def counted(*args, **kwargs):
        out = one(*args, **kwargs)
        counter[0] += out is not None
        return out

    gen.target.decode_one = counted
    return counter


def run(gen: Generator, lean: list[int], ids: list[int], params: SamplingParams, method: str,
        k) -> tuple:
    """(tokens, seconds, target forwards, output ids, lean plain steps) of one prompt."""
    before = lean[0]
    t0 = time.perf_counter()
    (s,) = generate_ids(gen, [ids], params, method, k)
    return (len(s.output_ids), time.perf_counter() - t0, s.stats.target_forwards, s.output_ids,
            lean[0] - before)


def table(totals: dict, configs: list, names: list[str], prompts: int) -> list[dict]:
    """Per method and k, per rule set: x its plain decoding, tau, the share of decode steps
    run lean, whether every output equalled plain decoding's."""
    rows = []
    for m, k in configs:
        row = {"method": m, "k": k}
        for name in names:
            base, t = totals[(name, "none", None)], totals[(name, m, k)]
            row[name] = {"x_plain": t[5] / t[1],  # plain seconds for its tokens / its seconds
                         "tau": t[0] / max(t[2], 1), "same": t[3],
                         "lean": t[4] / max(t[2] - prompts, 1),  # (a prefill a prompt)
                         "plain_tok_s": base[0] / base[1]}
        rows.append(row)
    return rows


def measure_prompt(gens: dict, lean: dict, prompt, params: SamplingParams, configs: list,
                   block: int, totals: dict) -> None:
    """One prompt under every configuration, the rule sets side by side (each configuration
    run on one engine, then at once on the other), plain decoding run on each engine before
    the first `block` configurations and after each block: a configuration's run counts
    against the plain runs just before and after its block (the load of a loaded machine
    drifts within minutes; one plain run a prompt would be a baseline at one moment)."""
    ids = {name: gen.encode(prompt, None) for name, gen in gens.items()}
    plain, last = {}, {}  # name -> plain output; name -> (tokens, seconds) of its last plain run
    for name, gen in gens.items():
        # the prompt's prefill shape warmed up first: else the first run pays it
        run(gen, lean[name], ids[name], SamplingParams(max_tokens=2, ignore_eos=True), "none",
            None)
        last[name], plain[name] = plain_run(gen, lean[name], ids[name], params, name, totals)
    for b in range(0, len(configs), block):
        done = []  # (name, config, tokens, seconds)
        for m, k in configs[b:b + block]:
            for name, gen in gens.items():
                n, sec, fw, out, ln = run(gen, lean[name], ids[name], params, m, k)
                t = totals.setdefault((name, m, k), [0, 0.0, 0, True, 0, 0.0])
                t[0] += n; t[1] += sec; t[2] += fw; t[3] &= out == plain[name]  # noqa: E702
                t[4] += ln
                done.append((name, (m, k), n))
        after = {name: plain_run(gen, lean[name], ids[name], params, name, totals)[0]
                 for name, gen in gens.items()}
        for name, (m, k), n in done:  # n tokens at the plain runs' rate around the block
            (n0, s0), (n1, s1) = last[name], after[name]
            totals[(name, m, k)][5] += n * (s0 + s1) / (n0 + n1)
        last = after


def plain_run(gen: Generator, lean: list[int], ids: list[int], params: SamplingParams,
              name: str, totals: dict) -> tuple[tuple[int, float], list[int]]:
    """Plain decoding of one prompt, counted under (name, "none") -> ((tokens, seconds), its
    output)."""
    n, sec, fw, out, ln = run(gen, lean, ids, params, "none", None)
    t = totals.setdefault((name, "none", None), [0, 0.0, 0, True, 0, 0.0])
    t[0] += n; t[1] += sec; t[2] += fw; t[4] += ln; t[5] += sec  # noqa: E702
    return (n, sec), out


def stamp() -> str:
    """When, on what, at which load: the line every table of this script carries."""
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    flags = [f for f in ("avx2", "avx512f", "avx512_vnni", "amx_tile", "amx_int8")
             if f in open("/proc/cpuinfo").read().split()]
    return (f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, commit {commit}, "
            f"{os.cpu_count()} CPUs ({' '.join(flags)}), load {os.getloadavg()[0]:.1f}")


def main() -> None:
    a = parse_args()
    ks = [k if k.startswith("auto") else int(k) for k in a.ks.split(",")]
    configs = [(m, k) for m in a.methods.split(",") for k in ks]
    print("start:", stamp(), flush=True)
    gens = {name: Generator(a.engine, max_len=1024, threads=a.threads, prefix_cache=False,
                            speculation=rules) for name, rules in RULES.items()}
    lean = {name: count_lean(gen) for name, gen in gens.items()}
    prompts = load_prompts(a.prompts)[:a.num_prompts]
    schemas = load_schemas(a.prompts)[:a.num_prompts]
    # (rules, method, k) -> [tokens, seconds, forwards, same, lean steps, the seconds plain
    # decoding took for as many tokens around its runs]
    totals: dict[tuple, list] = {}
    for name, gen in gens.items():  # warm-up: graphs, cost probe
        for m, k in [("none", None)] + configs:
            generate_ids(gen, [gen.encode(prompts[0], None)],
                         SamplingParams(max_tokens=8, ignore_eos=True), m, k)
    for i, (prompt, schema) in enumerate(zip(prompts, schemas)):
        params = SamplingParams(max_tokens=a.max_new_tokens, ignore_eos=schema is None,
                                json_schema=json.dumps(schema) if schema else None)
        # the order rotated a prompt: no configuration always first after the plain runs
        at = i * len(configs) // len(prompts)
        measure_prompt(gens, lean, prompt, params, configs[at:] + configs[:at], a.block,
                       totals)
        print(f"prompt {i + 1}/{len(prompts)} done, load {os.getloadavg()[0]:.1f}", flush=True)
        if a.json:  # the table so far, should the run be cut short
            with open(a.json, "w") as f:
                json.dump({"args": vars(a), "prompts_done": i + 1,
                           "rows": table(totals, configs, list(gens), i + 1)}, f, indent=1)
    rows = table(totals, configs, list(gens), len(prompts))
    for row in rows:
        print(f"{row['method']:8s} k={str(row['k']):5s} " + "  ".join(
            f"{name} {row[name]['x_plain']:.3f} (tau {row[name]['tau']:.2f}, lean "
            f"{row[name]['lean']:.2f}, same {row[name]['same']})" for name in gens), flush=True)
    for name, gen in gens.items():
        base = totals[(name, "none", None)]
        costs = gen.engine.planner.draft_length.costs
        measured = {str(d): round(m, 3) for (d, b), (m, n) in costs.measured.items()
                    if b == 1 and n}
        print(f"{name}: plain {base[0] / base[1]:.1f} tok/s; a drafting step's time past "
              f"its drafting over the c(T) curve's, by drafter: {measured}")
    print("end:", stamp(), flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"args": vars(a), "prompts_done": len(prompts), "rows": rows}, f,
                      indent=1)


if __name__ == "__main__":
    main()
