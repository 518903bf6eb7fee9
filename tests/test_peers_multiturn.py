"""scripts/multiturn_peers.py on the tiny engine: every turn of every chat answered by ours
(serve, prefix cache on) and by onnxruntime-genai where installed (its generator kept across
turns: rewound, then appended), a peer that cannot load listed as skipped with its reason."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.script_util import SCRIPTS
from trt_spec.tools import peers as peer_registry


def test_multiturn_peers_reuse_the_history(tiny_engine, tmp_path):
    chats = tmp_path / "chats.jsonl"
    chats.write_text("".join(json.dumps({"id": f"c{i}", "turns": [f"{w} " * 12, "x y", "z"]})
                             + "\n" for i, w in enumerate(("a", "b"))))
    out = tmp_path / "multiturn.json"
    result = subprocess.run(
        [sys.executable, str(SCRIPTS / "multiturn_peers.py"), "--engine", str(tiny_engine),
         "--conversations", str(chats), "--max-tokens", "6", "--threads", "1",
         "--peers", "onnxruntime-genai,llama.cpp", "--json", str(out)],
        capture_output=True, text=True, timeout=600,
        env={**__import__("os").environ, "TRT_SPEC_CACHE": str(tmp_path / "cache")})
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads(out.read_text())
    # the tiny engine's model is a Hugging Face folder: llama.cpp (which needs a GGUF) is
    # skipped with the reason, where it is installed at all
    ok, reason = peer_registry.PEERS["llama.cpp"]().available()
    assert "llama.cpp" in report["skipped"]
    assert ("a Hugging Face folder, not a GGUF" in report["skipped"]["llama.cpp"] if ok
            else report["skipped"]["llama.cpp"] == reason)
    ort = peer_registry.PEERS["onnxruntime-genai"]().available()[0]
    names = ["ours (serve)"] + (["onnxruntime-genai (append_tokens)"] if ort else [])
    assert list(report["runtimes"]) == names, report["skipped"]
    assert [t["turn"] for t in report["turns"]] == [1, 2, 3]
    for name in names:
        runs = report["runs"][name]
        assert len(runs) == 6 and all(r["ttft_s"] > 0 for r in runs)
        # every later turn reads the turn before from what the runtime kept
        assert all(r["reused_tokens"] > 0 for r in runs if r["turn"] > 1), (name, runs)
        assert all(r["reused_tokens"] < r["prompt_tokens"] for r in runs)
    first = [r["prompt_tokens"] for r in report["runs"]["ours (serve)"]]
    for name in names:  # one template, one prompt for every runtime
        assert [r["prompt_tokens"] for r in report["runs"][name]][::3] == first[::3]
    assert "| turn |" in result.stdout
