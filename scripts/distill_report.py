"""What a folder of self-distilled answers (train/distill_data.py) holds, as Markdown: shards,
trajectories, answers by turn and variant, answer tokens, how many ended at the end-of-turn
token, and the bytes on disk; `--write` puts it in the folder's README.md.

    python scripts/distill_report.py train/data/smollm2-135m [--write]
"""

from __future__ import annotations

import argparse
import json
from collections import Counter
from pathlib import Path

import numpy as np

from trt_spec.train.distill_data import read_shards


def summary(folder: Path) -> dict:
    shards = read_shards(folder)
    if not shards:
        return {"shards": 0}
    cat = {k: np.concatenate([s[k] for s in shards]) for k in ("conv", "variant", "turn",
                                                                "stopped")}
    lengths = np.concatenate([np.diff(s["offsets"]) for s in shards])
    trajectories = set(zip(cat["conv"].tolist(), cat["variant"].tolist()))
    return {
        "shards": len(shards),
        "conversations": len(set(cat["conv"].tolist())),
        "trajectories": len(trajectories),
        "answers": len(lengths),
        "answer_tokens": int(lengths.sum()),
        "mean_answer_tokens": float(lengths.mean()),
        "stopped": float(cat["stopped"].mean()),
        "answers_by_turn": dict(sorted(Counter((cat["turn"] + 1).tolist()).items())),
        "answers_by_variant": dict(sorted(Counter(cat["variant"].tolist()).items())),
        "bytes": sum(p.stat().st_size for p in folder.glob("shard-*.npz")),
    }


def size(n: int) -> str:
    return f"{n / 1e6:.1f} MB" if n >= 1e6 else f"{n / 1e3:.0f} kB"


def markdown(folder: Path) -> str:
    lines = [f"# Self-distilled answers: `{folder}`", "",
             "Written by `trt-spec train --answers distill` (train/distill_data.py); "
             "docs/training.md says how they are made and read. Regenerate this file with "
             f"`python scripts/distill_report.py {folder} --write`.", ""]
    manifest = folder / "manifest.json"
    if manifest.exists():
        lines += ["Settings (`manifest.json`):", "", "```json",
                  manifest.read_text().strip(), "```", ""]
    for name, sub in (("training", folder), ("held-out", folder / "heldout")):
        s = summary(sub) if sub.is_dir() else {"shards": 0}
        lines += [f"## {name.capitalize()}", ""]
        if not s["shards"]:
            lines += ["No shard yet.", ""]
            continue
        lines += ["| | |", "|---|---|"]
        lines += [f"| shards | {s['shards']} |",
                  f"| conversations | {s['conversations']:,} |",
                  f"| trajectories (conversation × variant) | {s['trajectories']:,} |",
                  f"| answers | {s['answers']:,} |",
                  f"| answer tokens | {s['answer_tokens']:,} |",
                  f"| mean answer | {s['mean_answer_tokens']:.0f} tokens |",
                  f"| ended at end-of-turn | {s['stopped']:.0%} |",
                  "| answers by turn | " + ", ".join(
                      f"{k}: {v:,}" for k, v in s["answers_by_turn"].items()) + " |",
                  "| answers by variant (0: greedy) | " + ", ".join(
                      f"{k}: {v:,}" for k, v in s["answers_by_variant"].items()) + " |",
                  f"| on disk | {size(s['bytes'])} |", ""]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("folder", type=Path)
    ap.add_argument("--write", action="store_true", help="write FOLDER/README.md")
    ap.add_argument("--json", action="store_true", help="the training summary as JSON")
    args = ap.parse_args()
    if not args.folder.is_dir():
        ap.error(f"{str(args.folder)!r} is not a folder")
    if args.json:
        print(json.dumps(summary(args.folder), indent=1))
        return
    text = markdown(args.folder)
    if args.write:
        (args.folder / "README.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
