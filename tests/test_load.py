"""`make load`'s script works end to end (a few seconds, 2 clients, tiny engine). The real
figures come from `make load` on SmolLM2, not from a test (the machine is shared)."""

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "load.py"


def test_load_script_reports(tiny_engine, tmp_path):
    out = tmp_path / "load.json"
    result = subprocess.run([sys.executable, str(SCRIPT), "--engine", str(tiny_engine),
                             "--clients", "2", "--duration", "2", "--max-tokens", "8",
                             "--json", str(out), "--", "--max-num-seqs", "2", "--threads", "1"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads(out.read_text())
    assert report["passed"] and report["errors"] == 0 and report["server_exit_code"] == 0
    assert report["requests"] > 0 and report["tokens_per_s"] > 0
    assert report["requests_per_s"] == report["requests"] / report["elapsed_s"]
    assert 0 < report["latency_s"]["p50"] <= report["latency_s"]["p99"]
    assert report["rss_mb"]["before"] > 0 and report["rss_mb"]["after"] > 0
    for word in ("requests", "tokens", "latency", "p50", "p99", "errors 0", "server RSS", "PASS"):
        assert word in result.stdout
