"""bench's `same` column for seeded sampling, one held-out prompt at a time, resumable.

`same` (identical_to_baseline) is the share of answers that equal plain decoding's with the
same seed. On 2 shared cores, every method x k on 16 prompts x 96 tokens is hours of work, so
this runs bench's passes (tools/bench.py: open_session, run_passes, collect_results; no
warm-up and no step costs, which `same` does not need) on one prompt per call, writes that
prompt's rows to OUT/T<temperature>/p<index>.json, skips any prompt already written, and
prints the table over every prompt written so far. A run cut short loses one prompt at most;
run it again to go on. Each call starts from an empty suffix cache, so no prompt's answer
drafts another's.

    python scripts/seeded_same.py --engine engines/smollm2-135m --temperature 0.8 \
        --out bench-same [--num-prompts 16 --max-new-tokens 96 --top-p 0.95 --seed 1]
    python scripts/seeded_same.py --out bench-same --report   # the table only
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from trt_spec.tools.bench import collect_results, load_peer_family, open_session, run_passes
from trt_spec.tools.bench_config import BenchConfig

METHODS = ("none", "vanilla", "ngram", "suffix", "mtp", "eagle", "eagle3", "hybrid", "auto")
KS = (1, 2, 4, "auto")
HELDOUT = Path("runtime/data/sharegpt-heldout.jsonl")


def one_prompt(args, index: int, folder: Path) -> Path:
    """Prompt `index` of the held-out file alone in a file bench can read."""
    line = HELDOUT.read_text().splitlines()[index]
    path = folder / f"p{index}.jsonl"
    path.write_text(line + "\n")
    return path


def run_prompt(args, index: int, folder: Path) -> None:
    out = folder / f"p{index}.json"
    if out.exists():
        return
    config = BenchConfig(engines=(args.engine,), methods=METHODS, ks=KS,
                         max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                         top_p=args.top_p, seed=args.seed, repeats=1, threads=args.threads,
                         prompts_file=str(one_prompt(args, index, folder)), num_prompts=1)
    session = open_session(config, lambda msg: None)
    load_peer_family(session)  # (none asked: its runner only)
    run_passes(session)
    rows = [{k: r[k] for k in ("method", "num_draft_tokens", "identical_to_baseline", "tau",
                               "acceptance_rate")} for r in collect_results(session)]
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(rows))
    tmp.replace(out)  # whole or absent: a cut run never leaves half a prompt
    print(f"T {args.temperature}: prompt {index} written", flush=True)


def report(out: Path) -> None:
    """Per temperature, method and k: answers equal to plain's over the prompts written."""
    for folder in sorted(p for p in out.glob("T*") if p.is_dir()):
        rows: dict[tuple, tuple[int, int]] = {}
        files = sorted(folder.glob("p*.json"))
        for f in files:
            for r in json.loads(f.read_text()):
                if r.get("method") in (None, "none") or r.get("identical_to_baseline") is None:
                    continue
                key = (r["method"], str(r["num_draft_tokens"]))
                same, n = rows.get(key, (0, 0))
                rows[key] = (same + (r["identical_to_baseline"] == 1.0), n + 1)  # one prompt
        print(f"{folder.name[1:]}: {len(files)} prompts")
        for (method, k), (same, n) in sorted(rows.items()):
            print(f"  {method:8} k {k:7} same {same}/{n} = {same / n:.2f}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--engine", default="engines/smollm2-135m")
    ap.add_argument("--out", default="bench-same", help="folder of per-prompt results")
    ap.add_argument("--temperature", type=float, default=0.8)
    ap.add_argument("--top-p", type=float, default=0.95)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--report", action="store_true", help="print the table only")
    args = ap.parse_args(argv)
    out = Path(args.out)
    if not args.report:
        folder = out / f"T{args.temperature}"
        folder.mkdir(parents=True, exist_ok=True)
        for i in range(args.num_prompts):
            run_prompt(args, i, folder)
    report(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
