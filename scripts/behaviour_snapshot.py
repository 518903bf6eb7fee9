"""What a refactor must not change: greedy tokens and tau for every method and k, and sampled
draws for a fixed seed, on held-out prompts. Writes one JSON; `--compare OTHER.json` says
which runs differ.

    python scripts/behaviour_snapshot.py --engine engines/smollm2-135m --out before.json
    python scripts/behaviour_snapshot.py --engine engines/smollm2-135m --out after.json \
        --compare before.json

The policy's gain rules are off (spec_fallback=False): with them on, a step's k follows
measured step costs, which vary from run to run, so tau would too.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from trt_spec import LLM, SamplingParams

METHODS = ("none", "vanilla", "ngram", "suffix", "mtp", "eagle", "eagle3", "hybrid", "auto")


def prompts(path: Path, n: int) -> list[list[dict]]:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r["messages"][:1] for r in rows[:n]]


def runs(engine: str, chats, max_tokens: int, batch: int, methods) -> dict:
    out = {}
    for method in methods:
        for k in ((0,) if method == "none" else (2, 4)):
            llm = LLM(engine, method=method, num_draft_tokens=max(k, 1), spec_fallback=False,
                      max_num_seqs=batch)
            greedy = llm.generate(chats, SamplingParams(max_tokens=max_tokens))
            key = f"{method} k={k}"
            out[key] = {"greedy": [o.token_ids for o in greedy],
                        "tau": [o.metrics.tau for o in greedy]}
            if k in (0, 4):
                drawn = [llm.generate([chat], SamplingParams(
                    max_tokens=max_tokens, temperature=0.8, top_p=0.9, top_k=50,
                    seed=100 + i))[0] for i, chat in enumerate(chats)]
                out[key]["sampled"] = [o.token_ids for o in drawn]
            print(key, "tau", [round(t or 0, 3) for t in out[key]["tau"]], flush=True)
    return out


def compare(now: dict, before: dict) -> int:
    bad = 0
    for key, run in before.items():
        if key not in now:
            continue
        for field, value in run.items():
            if now.get(key, {}).get(field) != value:
                bad += 1
                print(f"DIFFERS: {key} {field}")
    plain = now.get("none k=0", before.get("none k=0"))["greedy"]
    for key, run in now.items():
        same = sum(a == b for a, b in zip(run["greedy"], plain))
        print(f"{key:14s} greedy equal to plain {same}/{len(plain)}")
    print("unchanged" if not bad else f"{bad} fields differ")
    return bad


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engine", default="engines/smollm2-135m")
    ap.add_argument("--prompts", default="runtime/data/sharegpt-heldout.jsonl", type=Path)
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--batch", type=int, default=4, help="KV slots (streams batched)")
    ap.add_argument("--methods", default=",".join(METHODS),
                    help=f"comma-separated, of {', '.join(METHODS)}")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--compare", type=Path)
    args = ap.parse_args()
    methods = args.methods.split(",")
    bad = [m for m in methods if m not in METHODS]
    if bad:
        ap.error(f"--methods {','.join(bad)}: expected some of {', '.join(METHODS)}")
    now = runs(args.engine, prompts(args.prompts, args.num_prompts), args.max_tokens,
               args.batch, methods)
    args.out.write_text(json.dumps(now))
    if args.compare:
        return 1 if compare(now, json.loads(args.compare.read_text())) else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
