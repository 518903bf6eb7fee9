"""Edge-deployment figures (`make edge-report`): environment sizes, cold start and peak RSS of
the runtime-only install on an int4 target + Eagle3 bundle.

    python scripts/edge_report.py --engine engines/smollm2-135m-eagle3 [--json out.json]

Steps (each skipped when its output exists):
  1. the bundle (`trt-spec bundle ENGINE OUT --methods eagle3`) from the export environment
  2. a runtime-only venv (.venv-runtime): `pip install --no-deps -r BUNDLE/requirements.txt`
     (the closed, pinned runtime set), then this project with --no-deps (reinstalled each run)
  3. in the runtime venv: cold start = process start -> exit after one greedy token
     (`trt-spec generate --max-tokens 1`; so it is an upper bound of time to first token),
     median of 5; peak RSS of a 256-token eagle3 generation (the child's ru_maxrss)
Goals (edge issue): runtime env <= 100 MB beyond onnxruntime, cold start <= 1.5 s,
peak RSS <= 1.5 x the bundle's size on disk.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def du(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file() and not p.is_symlink())


def site_packages(venv: Path) -> Path:
    return next((venv / "lib").glob("python3*/site-packages"))


def run_child(cmd: list[str], env: dict) -> tuple[float, int, subprocess.CompletedProcess | None]:
    """Wall seconds and peak RSS (bytes) of one child process."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t0
    out, err = proc.stdout.read().decode(), proc.stderr.read().decode()
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{err[-2000:]}")
    return wall, usage.ru_maxrss * 1024, out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engine", required=True, help="engine folder with an eagle3 drafter")
    ap.add_argument("--bundle", default=None, help="bundle folder [default: ENGINE-bundle]")
    ap.add_argument("--venv", default=str(REPO / ".venv-runtime"))
    ap.add_argument("--export-venv", default=str(REPO / ".venv"))
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    bundle = Path(args.bundle or f"{args.engine.rstrip('/')}-bundle")
    if not bundle.exists():
        print(f"bundling {args.engine} -> {bundle} ...", file=sys.stderr)
        subprocess.run([str(Path(args.export_venv) / "bin" / "trt-spec"), "bundle", args.engine,
                        str(bundle), "--methods", "eagle3"], check=True)
    venv = Path(args.venv)
    pip = [str(venv / "bin" / "pip"), "install", "-q", "--no-deps"]
    if not (venv / "bin" / "pip").exists():
        print(f"creating the runtime-only environment {venv} ...", file=sys.stderr)
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        subprocess.run(pip + ["-r", str(bundle / "requirements.txt")], check=True)
    subprocess.run(pip + ["--force-reinstall", str(REPO)], check=True)

    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    cli = str(venv / "bin" / "trt-spec")
    sp = site_packages(venv)
    tooling = sum(du(p) for p in sp.iterdir()  # the venv's own pip / setuptools
                  if p.name.split("-")[0] in ("pip", "setuptools", "_distutils_hack",
                                              "pkg_resources", "distutils-precedence.pth"))
    runtime_bytes = du(sp) - tooling
    ort_bytes = du(sp / "onnxruntime")
    export_bytes = du(site_packages(Path(args.export_venv)))
    bundle_bytes = sum(p.stat().st_size for p in bundle.iterdir())

    prompt = "What are three good reasons to learn to cook at home?"
    run_child([cli, "generate", "--engine", str(bundle), "--max-tokens", "1", prompt], env)  # warm the page cache
    starts = [run_child([cli, "generate", "--engine", str(bundle), "--max-tokens", "1",
                         "--method", "eagle3", prompt], env)[0] for _ in range(args.runs)]
    _, rss, out = run_child([cli, "generate", "--engine", str(bundle), "--method", "eagle3",
                             "--max-tokens", str(args.tokens), "--json", prompt], env)
    metrics = json.loads(out)["metrics"]

    report = {
        "bundle": str(bundle),
        "bundle_mb": bundle_bytes / 1e6,
        "runtime_env_mb": runtime_bytes / 1e6,
        "onnxruntime_mb": ort_bytes / 1e6,
        "runtime_env_beyond_onnxruntime_mb": (runtime_bytes - ort_bytes) / 1e6,
        "export_env_mb": export_bytes / 1e6,
        "cold_start_s": {"median": statistics.median(starts), "runs": starts},
        "peak_rss_mb": rss / 1e6,
        "peak_rss_over_bundle": rss / bundle_bytes,
        "generation": {"tokens": metrics["completion_tokens"], "tau": metrics["tau"],
                       "decode_tokens_per_s": metrics["decode_tokens_per_s"]},
        "goals": {"runtime_env_beyond_onnxruntime_mb<=100": (runtime_bytes - ort_bytes) <= 100e6,
                  "cold_start_s<=1.5": statistics.median(starts) <= 1.5,
                  "peak_rss<=1.5x_bundle": rss <= 1.5 * bundle_bytes},
    }
    print(json.dumps(report, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
