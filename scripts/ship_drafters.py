"""Copy a training run's drafters into drafters/<model>/ with a model card each.

    python scripts/ship_drafters.py --run runs/gpu1 --bench runs/gpu1/bench-heldout-k4.json \
        --model smollm2-135m --trained-on "..." --command "..."

The card states the data, the tokens seen, the steps, the final and held-out losses and
accuracies (train/ metrics.json) and τ / acceptance / tokens/s measured by `trt-spec bench`
on held-out prompts (its JSON report), with the commands that produced them.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

METHOD = {"eagle3": "eagle3", "mtp": "mtp", "eagle": "eagle", "draft": "vanilla"}
WHAT = {
    "eagle3": "EAGLE-3 head: fc(3H→H) over the target's layers {layers}, one decoder layer with "
              "2H-wide attention input (MLP width {inter}), a {vocab}-token draft vocabulary",
    "mtp": "{n} chained MTP modules (DeepSeek-V3 layout; module i drafts token i+1), one decoder "
           "layer each (MLP width {inter}), the target's embedding and head",
    "eagle": "one MTP-style module, looped (MLP width {inter}), the target's embedding and head",
    "draft": "a {n}-layer vanilla draft model started from the target's layers {layers}, the "
             "target's embedding and (tied) head",
}


def describe(kind: str, meta: dict) -> str:
    c = meta.get("layer_config") or meta.get("model_config") or {}
    return WHAT[kind].format(layers=meta.get("feature_layers") or meta.get("source_layers"),
                             inter=c.get("intermediate_size"), vocab=meta.get("draft_vocab_size"),
                             n=meta.get("num_modules") if kind == "mtp" else c.get("num_layers"))


def bench_rows(report: dict, method: str) -> list[dict]:
    return [r for r in report["results"] if r.get("method") == method]


def card(kind: str, meta: dict, metrics: dict, reports: list, args) -> str:
    m = metrics[kind]
    cfg = m.get("config") or {}
    seen = m["train_tokens"] * args.epochs * m["step"] / m["total_steps"]
    held = {k[len("heldout_"):]: v for k, v in m.items() if k.startswith("heldout_acc")}
    lines = [f"# {args.model} — {kind} drafter", "",
             describe(kind, meta) + ".", "",
             "## Training", "",
             f"- Data: {args.trained_on}",
             *([f"- Started from: {args.started_from}"] if args.started_from else []),
             f"- Tokens: {m['train_tokens']:,} training tokens (prompt + answer, ≤ {args.max_len} per "
             f"conversation); seen ≈ {seen:,.0f} ({m['step']} of {m['total_steps']} steps of "
             f"{args.batch_size} sequences; the run's time limit stopped it before its "
             "cosine schedule ended)" if not m["done"] else
             f"- Tokens: {m['train_tokens']:,} training tokens; seen {seen:,.0f} "
             f"({m['step']} steps of {args.batch_size} sequences)",
             f"- Loss: soft cross entropy against the target's top-32 distribution; final "
             f"training loss {m['loss']:.3f}, held-out {m.get('heldout_loss', float('nan')):.3f}",
             "- Held-out accuracy (the drafter's argmax is the target's, teacher forced, by "
             "draft step / module): " + ", ".join(f"{v:.3f}" for v in held.values()),
             f"- Training time: {m['seconds']:.0f} s ({args.where})",
             f"- Command: `{args.command}`", ""]
    lines += ["## Measured", "",
              "`trt-spec bench` on held-out ShareGPT prompts (runtime/data/sharegpt-heldout.jsonl: "
              f"the training split never saw them), greedy, chain drafts, {args.machine}. τ = "
              "tokens per target forward, bonus token included:", "",
              "| engine | prompts | new tokens | k | τ | acceptance by position | tokens/s | × none | identical to none |",
              "|---|---|---|---|---|---|---|---|---|"]
    for report, command in reports:
        s = report["settings"]
        for r in bench_rows(report, METHOD[kind]):
            acc = " ".join(f"{a:.2f}" for a in r["acceptance_per_position"])
            lines.append(
                f"| {r['precision']} | {s['num_prompts']} | {s['max_new_tokens']} "
                f"| {r['num_draft_tokens']} | {r['tau']:.2f} | {acc} "
                f"| {r['tokens_per_s']['median']:.1f} | {r['speedup_vs_none']:.2f} "
                f"| {r['identical_to_baseline']:.2f} |")
    lines += ["", "Identical-to-none below 1 on int4 is MatMulNBits' near-tie effect (a "
              "multi-token step rounds activations differently; README); fp32 is exact.", ""]
    lines += [f"Command: `{command}`" for _, command in reports]
    lines += ["",
              "## Format", "",
              "trt-spec's own drafter format (drafter.json + fp16 model.safetensors); the "
              "target's embedding is not stored (the loader takes it from the target). "
              f"`trt-spec export --model {args.model}` exports it with the target.", ""]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run", type=Path, required=True)
    ap.add_argument("--bench", type=Path, action="append", required=True,
                    help="a `trt-spec bench --json` report (repeatable, with --bench-command)")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--epochs", type=float, default=2.0)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--trained-on", required=True)
    ap.add_argument("--where", required=True)
    ap.add_argument("--machine", required=True)
    ap.add_argument("--command", required=True)
    ap.add_argument("--bench-command", action="append", required=True)
    ap.add_argument("--methods", default=",".join(METHOD),
                    help="the run's drafters to ship (comma-separated; the others stay)")
    ap.add_argument("--max-len", type=int, default=512, help="training tokens per conversation")
    ap.add_argument("--started-from", default=None,
                    help="what a fine-tuned drafter started from (--init-from), for its card")
    args = ap.parse_args()
    unknown = [k for k in args.methods.split(",") if k not in METHOD]
    if unknown:
        ap.error(f"--methods {args.methods!r}: expected some of {', '.join(METHOD)}")
    out = args.out or Path(__file__).resolve().parents[1] / "drafters" / args.model
    metrics = json.loads((args.run / "metrics.json").read_text())
    if len(args.bench) != len(args.bench_command):
        ap.error("give one --bench-command per --bench")
    reports = [(json.loads(b.read_text()), c) for b, c in zip(args.bench, args.bench_command)]
    for kind in args.methods.split(","):
        src = args.run / kind
        dst = out / kind
        if dst.exists():
            shutil.rmtree(dst)
        dst.mkdir(parents=True)
        for name in ("drafter.json", "model.safetensors"):
            shutil.copy2(src / name, dst / name)
        meta = json.loads((src / "drafter.json").read_text())
        (dst / "MODEL_CARD.md").write_text(card(kind, meta, metrics, reports, args))
        print(f"{dst}: {sum(f.stat().st_size for f in dst.iterdir()) / 1e6:.1f} MB")


if __name__ == "__main__":
    main()
