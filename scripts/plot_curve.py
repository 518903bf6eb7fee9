"""Plot learning curves written by `trt-spec train --eval-every TOKENS`: held-out top-1 by draft
step (acc_0 solid, later steps fainter) and tau_est (train/curve.py: an estimate; `trt-spec
bench` measures τ)
against training tokens seen, one line per curve file.

    python scripts/plot_curve.py runs/r/eagle3-curve.jsonl runs/r/mtp-curve.jsonl \\
        --out docs/img/smollm2-curve.png [--title "SmolLM2-135M, ShareGPT"]

Needs matplotlib (pip install -e '.[bench]'); nothing else of the project (no torch).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def read_records(path: Path) -> list[dict]:
    """A curve file's records; a torn last line (a crash mid-write) is dropped."""
    lines = Path(path).read_text().splitlines()
    out = []
    for i, line in enumerate(lines):
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            if i < len(lines) - 1:
                raise ValueError(f"{path}: line {i + 1} is not JSON: {line[:80]!r}") from None
    if not out:
        raise ValueError(f"{path}: no records (was the run started with --eval-every?)")
    return out


def label(path: Path, paths: list[Path]) -> str:
    """'eagle3' from OUT/eagle3-curve.jsonl; 'OUT/eagle3' when two files share the method."""
    name = path.name.removesuffix(".jsonl").removesuffix("-curve")
    same = [p for p in paths if p.name == path.name]
    return f"{path.parent.name}/{name}" if len(same) > 1 else name


def plot(curves: dict[str, list[dict]], out: Path, title: str | None = None) -> None:
    try:
        import matplotlib
    except ImportError as e:
        raise SystemExit("plot_curve.py needs matplotlib: pip install -e '.[bench]'") from e
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_acc, ax_tau) = plt.subplots(2, 1, figsize=(7, 7), sharex=True)
    for name, records in curves.items():
        tokens = [r["tokens_seen"] for r in records]
        steps = min(len(r["acc"]) for r in records)
        line = None
        for j in range(steps):  # one colour per curve, draft steps fainter and dashed
            line, = ax_acc.plot(tokens, [r["acc"][j] for r in records],
                                marker="." if j == 0 else None,
                                color=None if line is None else line.get_color(),
                                linestyle="-" if j == 0 else "--",
                                alpha=1.0 if j == 0 else 0.6 - 0.1 * min(j, 4),
                                label=f"{name}, step {j + 1}" if j in (0, steps - 1) else None)
        ks = sorted({r["k"] for r in records})
        ax_tau.plot(tokens, [r["tau_est"] for r in records], marker=".",
                    label=f"{name} (k={','.join(map(str, ks))})")
    ax_acc.set_ylabel("held-out top-1 by draft step")
    ax_tau.set_ylabel("tau_est (tokens / target forward)")
    ax_tau.set_xlabel("training tokens seen")
    ax_tau.axhline(1.0, color="black", linewidth=0.5)
    for ax in (ax_acc, ax_tau):
        ax.grid(alpha=0.3)
        ax.legend()
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("curves", nargs="+", type=Path, help="OUT/<method>-curve.jsonl files")
    parser.add_argument("--out", type=Path, required=True, help="the .png to write")
    parser.add_argument("--title", default=None)
    args = parser.parse_args(argv)
    missing = [str(p) for p in args.curves if not p.is_file()]
    if missing:
        parser.error(f"no such curve file: {', '.join(map(repr, missing))}")
    try:
        curves = {label(p, args.curves): read_records(p) for p in args.curves}
    except ValueError as e:
        parser.error(str(e))
    plot(curves, args.out, args.title)
    print(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
