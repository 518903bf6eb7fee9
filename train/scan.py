"""Learning rate and warm-up chosen from short runs (`trt-spec train --lr-scan ...`).

Each combination (lr, warm-up) trains the method for `tokens` training tokens into
OUT/scan/<method>-lr<lr>-wu<warm-up>/ with the full run's schedule shape over its own length
(warm-up, then the cosine down to min_lr_ratio: epochs = tokens / the data's tokens), then is
evaluated on the whole held-out set. best = the highest held-out acc_0, ties broken by the
mean accuracy over draft steps, then by scan order. A finished combination leaves
result.json beside its run and is not run again; an interrupted one resumes from its state.

Warm-up is capped at a tenth of a run (train/loop.py's lr_factor), so a short scan may run two
warm-ups as the same schedule: that is an error, not a silent tie.
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path
from typing import Callable

from trt_spec.train.configs import ScanConfig
from trt_spec.train.curve import by_step
from trt_spec.train.features import write_json
from trt_spec.train.loop import total_steps, train_settings


def run_name(method: str, lr: float, warmup: int) -> str:
    return f"{method}-lr{lr:g}-wu{warmup}"


def effective_warmup(warmup: int, total: int) -> int:
    """The warm-up lr_factor runs in a `total`-step run."""
    return max(1, min(warmup, total // 10))


def check_warmups(scan: ScanConfig, total: int) -> None:
    """Two warm-ups that a `total`-step scan runs as the same schedule are an error."""
    seen = {}
    for w in scan.warmups:
        e = effective_warmup(w, total)
        if e in seen and seen[e] != w:
            raise ValueError(
                f"--warmup-scan {','.join(map(str, scan.warmups))}: a {scan.tokens}-token scan "
                f"is {total} steps and warm-up is capped at a tenth of a run ({total // 10} "
                f"steps), so {seen[e]} and {w} run the same schedule; raise --scan-tokens or "
                "scan smaller warm-ups")
        seen[e] = w


def best(runs: list[dict]) -> dict:
    """The run with the highest held-out acc_0, then mean accuracy; the first of equals."""
    return max(runs, key=lambda r: (r["acc"][0], r["acc_mean"]))


def scan_method(config, method: str, store, heldout, target,
                on_run: Callable[[dict], None] | None = None) -> dict:
    """Every combination of config.scan for `method` (config: pipeline.RunConfig), each run
    once. Returns {"tokens", "runs": [per combination: lr, warmup, warmup_run, steps, acc,
    acc_mean, loss, seconds, skipped], "best": {lr, warmup}}; on_run(run) as each ends."""
    from trt_spec.train.pipeline import evaluate_method, train_method

    scan = config.scan
    epochs = scan.tokens / store.tokens
    train = dataclasses.replace(config.train, epochs=epochs, eval_every=0)
    total = total_steps(len(store), train)
    check_warmups(scan, total)
    # what a finished combination must match to be reused (lr and warm-up are in its name)
    settings = json.loads(json.dumps({
        "tokens": scan.tokens, "sequences": len(store), "plan": store.manifest["plan"],
        "train": {k: v for k, v in train_settings(train).items()
                  if k not in ("lr", "warmup_steps")},
        "drafter": [config.draft_vocab, config.num_modules, config.draft_layers,
                    config.head_intermediate]}))
    runs = []
    for lr, warmup in scan.combinations:
        folder = Path(config.out) / "scan" / run_name(method, lr, warmup)
        done = folder / "result.json"
        if done.exists():
            run = json.loads(done.read_text())
            if run["settings"] != settings:
                raise ValueError(f"{done} is from another scan (other --scan-tokens, "
                                 f"settings or data); remove {folder.parent} or use another "
                                 "--out")
            run["skipped"] = True
        else:
            t0 = time.perf_counter()
            sub = dataclasses.replace(config, out=folder, max_minutes=None, scan=None,
                                      train=dataclasses.replace(train, lr=lr,
                                                                warmup_steps=warmup))
            metrics = train_method(sub, method, store, target, True, None, None)
            held = evaluate_method(sub, method, heldout, target, folder / method)
            acc = by_step(held, "acc")
            run = {"lr": lr, "warmup": warmup, "warmup_run": effective_warmup(warmup, total),
                   "steps": metrics["step"], "acc": acc, "acc_mean": sum(acc) / len(acc),
                   "loss": held["loss"], "seconds": time.perf_counter() - t0,
                   "settings": settings}
            write_json(done, run)
            run["skipped"] = False
        runs.append(run)
        if on_run:
            on_run(run)
    top = best(runs)
    return {"tokens": scan.tokens, "runs": runs,
            "best": {"lr": top["lr"], "warmup": top["warmup"]}}


def with_best(config, result: dict):
    """config (pipeline.RunConfig) with the scan's best lr and warm-up."""
    b = result["best"]
    return dataclasses.replace(config, train=dataclasses.replace(
        config.train, lr=b["lr"], warmup_steps=b["warmup"]))


def write_scan(out: Path, method: str, result: dict) -> None:
    """OUT/scan.json: {method: result}, other methods' results kept."""
    path = Path(out) / "scan.json"
    everything = json.loads(path.read_text()) if path.exists() else {}
    everything[method] = {**result, "runs": [{k: v for k, v in r.items()
                                              if k not in ("skipped", "settings")}
                                             for r in result["runs"]]}
    write_json(path, everything)


def scan_table(method: str, result: dict) -> str:
    """The scan as a text table, best marked with *."""
    b = result["best"]
    steps = max(len(r["acc"]) for r in result["runs"])
    head = (f"{'':2}{'lr':>9} {'warm-up':>8} {'steps':>6} "
            + " ".join(f"{f'acc_{j}':>6}" for j in range(steps)) + f" {'mean':>6} {'loss':>7}")
    rows = [f"scan {method}: {result['tokens']} tokens per run (*: best, held-out acc_0)", head]
    for r in result["runs"]:
        mark = "*" if (r["lr"], r["warmup"]) == (b["lr"], b["warmup"]) else " "
        wu = (str(r["warmup"]) if r["warmup_run"] == r["warmup"]
              else f"{r['warmup']}({r['warmup_run']})")
        rows.append(f"{mark:2}{r['lr']:>9.2e} {wu:>8} {r['steps']:>6} "
                    + " ".join(f"{a:>6.3f}" for a in r["acc"]) + f" {r['acc_mean']:>6.3f} "
                    f"{r['loss']:>7.3f}" + ("  (done before)" if r.get("skipped") else ""))
    return "\n".join(rows)
