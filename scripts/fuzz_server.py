"""Fuzz `trt-spec serve`: generated requests on every route, and what they did to the server.

Starts a server on ENGINE (default: the tests' tiny random model, built in a temporary
folder, ~10 s) with its log in a file, answers a greedy victim request, then sends EXAMPLES
requests drawn from the server's own request models (tests/fuzz_strategies.py: valid values
mixed with hostile ones) while a greedy victim stream runs beside them in a loop, then the
victim again. Prints the counts by status and by route, every distinct failure (a 5xx, an
error event blaming the server, a hang, a traceback in the log, a victim whose output
changed), the requests slower than 1 s and the server's RSS before and after. Exits 1 on
any failure.

    python scripts/fuzz_server.py --examples 10000 [--engine engines/x] [--json fuzz.json]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tests.fuzz_runner import campaign  # noqa: E402
from tests.server_util import start_server  # noqa: E402


def tiny_engine(folder: Path) -> Path:
    """The tests' tiny_spec_engine (tests/conftest.py): a random tiny Llama, vanilla draft."""
    from tests.conftest import make_tiny_hf
    from trt_spec.export.config import ExportConfig
    from trt_spec.export.pipeline import export_model

    target = make_tiny_hf(folder / "hf", seed=0)
    draft = make_tiny_hf(folder / "draft", seed=1, noisy_copy_of=target, noise=0.02)
    return export_model(ExportConfig(str(target), folder / "tiny-spec", "fp32",
                                     drafters={"vanilla": str(draft)}))


def distinct(failures: list[str]) -> Counter:
    """Failures grouped by what went wrong: numbers and the request body masked."""
    return Counter(re.sub(r"\d+", "N", f.split(" <- ")[0])[:240] for f in failures)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engine", help="engine folder [default: the tests' tiny model]")
    ap.add_argument("--examples", type=int,
                    default=int(os.environ.get("TRT_SPEC_FUZZ_EXAMPLES", 10000)))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-num-seqs", default="4")
    ap.add_argument("--log", help="the server's log [default: a temporary file]")
    ap.add_argument("--json", help="write the counts and every failure here")
    args = ap.parse_args()

    tmp = Path(tempfile.mkdtemp(prefix="fuzz-server-"))
    engine = args.engine or tiny_engine(tmp)
    log_path = Path(args.log or tmp / "server.log")
    with open(log_path, "w") as log:
        server = start_server(engine, "--max-num-seqs", args.max_num_seqs, stderr=log)
    try:
        run = campaign(server.url, args.examples, args.seed, log_path, server.proc.pid)
    finally:
        code = server.stop()
    t = run.tally
    print(f"{t.requests} requests in {t.seconds:.0f} s ({t.requests / t.seconds:.0f}/s), "
          f"seed {args.seed}; server log {log_path}; exit status {code}")
    print("by status:", dict(sorted(t.by_status().items(), key=str)))
    for route, counts in sorted(t.by_route().items()):
        print(f"  {route:32s} {dict(sorted(counts.items(), key=str))}")
    print(f"victim stream beside the run: {run.stream_runs} streams, "
          f"{len(run.stream_problems)} failed or differed")
    print(f"/health after: {run.health_status} in {run.health_s * 1000:.0f} ms; slowest "
          f"during the run (every 0.2 s): {run.health_max_s * 1000:.0f} ms")
    if run.rss_mb:
        print(f"server RSS: {run.rss_mb[0]:.0f} -> {run.rss_mb[1]:.0f} MB")
    for took, call in sorted(t.slow, key=lambda x: -x[0])[:10]:
        print(f"slow: {took} s {call!r:.200}")
    failures = run.failures
    print(f"{len(failures)} failures, {len(distinct(failures))} distinct:")
    for what, n in distinct(failures).most_common():
        print(f"  {n:5d} x {what}")
    if args.json:
        Path(args.json).write_text(json.dumps({
            "requests": t.requests, "seconds": t.seconds, "seed": args.seed,
            "by_status": {str(k): v for k, v in t.by_status().items()},
            "by_route": {r: {str(k): v for k, v in c.items()} for r, c in t.by_route().items()},
            "slow": [[s, c.show(20000)] for s, c in t.slow], "failures": failures,
            "failed_calls": [[p, c.show(200000)] for c, p in t.failures],
            "rss_mb": run.rss_mb, "victim_streams": run.stream_runs,
            "health_max_s": run.health_max_s}, indent=1))
    return 1 if failures or code != 0 else 0


if __name__ == "__main__":
    sys.exit(main())
