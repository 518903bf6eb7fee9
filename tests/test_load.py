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
    # the tiny engine serves method none: no suffix cache to fill, one warm-up round
    assert report["warmup"]["requests"] == 2 and report["rss_mb"]["start"] > 0
    for word in ("requests", "tokens", "latency", "p50", "p99", "errors 0", "server RSS", "PASS"):
        assert word in result.stdout


def test_load_script_compares_speculation_with_plain(tiny_spec_engine, tmp_path):
    """--compare-plain: the same workload with the server's method and with method none per
    request, at each concurrency; unseeded sampled requests, as clients send them."""
    out = tmp_path / "compare.json"
    result = subprocess.run([sys.executable, str(SCRIPT), "--engine", str(tiny_spec_engine),
                             "--compare-plain", "--concurrency", "1,2", "--rounds", "1",
                             "--duration", "1", "--max-tokens", "8", "--json", str(out), "--",
                             "--method", "ngram", "--max-num-seqs", "2", "--threads", "1"],
                            capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads(out.read_text())
    assert report["passed"] and not report["settings"]["seeded"]
    assert [lv["concurrency"] for lv in report["levels"]] == [1, 2]
    for lv in report["levels"]:
        for mode in ("speculative", "plain"):
            assert lv[mode]["requests"] > 0 and lv[mode]["errors"] == 0
            assert 0 < lv[mode]["tpot_p50_s"] <= lv[mode]["tpot_p99_s"]
        assert lv["throughput_ratio"] == (lv["speculative"]["tokens_per_s"]
                                          / lv["plain"]["tokens_per_s"])
    assert "TPOT p99" in result.stdout and "PASS" in result.stdout


def test_load_script_numbers_prompts_apart_when_unique():
    from tests.script_util import load_script

    load = load_script("load")
    assert load.messages(3) == load.messages(3 + len(load.PROMPTS))
    a, b = load.messages(3, True), load.messages(3 + len(load.PROMPTS), True)
    assert a != b and a[0]["content"].startswith("Request 3. ")


def test_replay_script_compares_with_and_without_the_prefix_cache(tiny_engine, tmp_path):
    convs = tmp_path / "convs.jsonl"
    convs.write_text("".join(json.dumps({"id": f"c{i}", "turns": [f"{w} " * 12, "x y", "z"]})
                             + "\n" for i, w in enumerate(("a", "b"))))
    out = tmp_path / "replay.json"
    script = SCRIPT.parent / "replay.py"
    result = subprocess.run([sys.executable, str(script), "--engine", str(tiny_engine),
                             "--compare", "--conversations", str(convs), "--max-tokens", "6",
                             "--min-tokens", "20", "--max-num-seqs", "2", "--json", str(out),
                             "--", "--threads", "1"],
                            capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads(out.read_text())
    assert report["answers_differ"] == 0 and report["conversations"] == 2
    assert [t["turn"] for t in report["turns"]] == [1, 2, 3]
    later = report["turns"][1:]
    assert all(t["cache"]["cached_tokens"] > 0 and t["no-cache"]["cached_tokens"] == 0
               for t in later)
    assert "answers identical with and without the cache: 6 of 6 turns" in result.stdout
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": "x", "turns": "not a list"}\n')
    result = subprocess.run([sys.executable, str(script), "--engine", str(tiny_engine),
                             "--conversations", str(bad)], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode != 0 and "needs 'turns'" in result.stderr
