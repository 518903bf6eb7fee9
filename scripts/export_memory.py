"""Peak RSS of `trt-spec export` per stage: where an export's memory goes.

    .venv/bin/python scripts/export_memory.py --model HF_FOLDER --out ENGINE [--precision P]

Runs export_model in this process with a thread sampling RSS every 20 ms; a stage is what
lies between two of the pipeline's log lines (export/pipeline.py log), named by the first.
Prints one line per stage: its peak RSS, in MiB and in bytes per parameter of the checkpoint.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


class Sampler(threading.Thread):
    """The process's peak RSS per stage (a stage starts at each `enter`)."""

    def __init__(self, period_s: float = 0.02):
        super().__init__(daemon=True)
        self.period_s = period_s
        self.process = psutil.Process()
        # [name, peak bytes, t0, RSS at the start]
        self.stages: list[list] = [["start", 0, time.time(), 0]]
        self.done = False

    def enter(self, name: str) -> None:
        self.sample()
        rss = self.process.memory_info().rss
        self.stages.append([name, rss, time.time(), rss])

    def sample(self) -> None:
        stage = self.stages[-1]
        stage[1] = max(stage[1], self.process.memory_info().rss)

    def run(self) -> None:
        while not self.done:
            self.sample()
            time.sleep(self.period_s)


def parameters(hf_dir: Path) -> int:
    """The checkpoint's parameter count, from its safetensors headers."""
    from safetensors import safe_open

    total = 0
    for f in hf_dir.glob("*.safetensors"):
        with safe_open(f, "np") as st:
            for key in st.keys():
                n = 1
                for d in st.get_slice(key).get_shape():
                    n *= d
                total += n
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--precision", default="int4-plain")
    parser.add_argument("--json", type=Path, help="write the stages here too")
    args = parser.parse_args()

    from trt_spec.export import pipeline
    from trt_spec.export.config import ExportConfig

    sampler = Sampler()
    original = pipeline.log

    def log(msg: str) -> None:
        sampler.enter(msg.strip().split(" (")[0][:70])
        original(msg)

    pipeline.log = log
    save = pipeline.save_with_external_data

    def saving(*a, **k):  # the graph's write is not logged: a stage of its own here
        sampler.enter("saving the graph")
        return save(*a, **k)

    pipeline.save_with_external_data = saving
    sampler.start()
    config = ExportConfig(model=args.model, out=args.out, precision=args.precision)
    pipeline.export_model(config, force=True)
    sampler.done = True
    sampler.enter("end")
    n = parameters(Path(args.model))
    rows = [{"stage": name, "start_mib": round(rss / 2**20), "peak_mib": round(peak / 2**20),
             "bytes_per_param": round(peak / n, 2), "s": round(t1 - t0, 1)}
            for (name, peak, t0, rss), (_, _, t1, _) in zip(sampler.stages, sampler.stages[1:])]
    print(f"{n / 1e6:.0f}M parameters; RSS at the start of each stage, its peak:")
    for r in rows:
        print(f"  {r['start_mib']:7d} -> {r['peak_mib']:7d} MiB  {r['bytes_per_param']:5.2f} "
              f"B/param  {r['s']:6.1f} s  {r['stage']}")
    if args.json:
        args.json.write_text(json.dumps({"parameters": n, "stages": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
