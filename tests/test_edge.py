"""Edge deployment: bundles, verify, doctor, and the runtime-only install (a clean venv with
the base dependencies, no torch, no transformers) generating from a bundle made here."""

import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import httpx
import pytest
from click.testing import CliRunner

from tests.server_util import start_server
from trt_spec.cli import main
from trt_spec.tools.bundle import bundle, verify
from trt_spec.runtime.manifest import EngineFolderError, load_manifest

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def eagle3_bundle(tiny_heads_engine, tmp_path_factory):
    return bundle(tiny_heads_engine, tmp_path_factory.mktemp("bundles") / "eagle3",
                  ["eagle3"], tar=True)


def test_bundle_holds_only_the_chosen_methods(eagle3_bundle):
    manifest = load_manifest(eagle3_bundle)  # checksums of everything in it
    assert sorted(manifest.data["drafters"]) == ["eagle3"]
    assert sorted(manifest.data["graphs"]) == ["eagle3", "eagle3_fc", "target"]
    names = {p.name for p in eagle3_bundle.iterdir()}
    assert not any(n.startswith(("mtp_", "eagle.", "draft.")) for n in names), names
    assert {"requirements.txt", "tokenizer.json", "eagle3_d2t.npy"} <= names
    assert set(manifest.data["files"]) | {"manifest.json"} == names
    reqs = (eagle3_bundle / "requirements.txt").read_text()
    assert "onnxruntime==" in reqs and "torch" not in reqs and "transformers" not in reqs
    assert manifest.data["bundle"]["methods"] == ["none", "eagle3"]
    with tarfile.open(str(eagle3_bundle) + ".tar.gz") as t:
        assert {Path(n).name for n in t.getnames()} >= names


def test_verify_reproduces_the_expected_output(eagle3_bundle):
    report = verify(eagle3_bundle)
    assert report["ok"] and report["requirements"] == []
    assert report["methods"]["none"]["identical"]
    assert report["methods"]["eagle3"]["tokens"] == 16


def test_verify_fails_loudly(eagle3_bundle, tiny_engine, tmp_path):
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(eagle3_bundle, broken)
    manifest = json.loads((broken / "manifest.json").read_text())
    manifest["bundle"]["expected"]["token_ids"][3] += 1
    (broken / "manifest.json").write_text(json.dumps(manifest))
    result = CliRunner().invoke(main, ["verify", str(broken)])
    assert result.exit_code == 1 and "FAILED" in result.output
    with open(broken / "eagle3.onnx.data", "r+b") as f:
        f.seek(100)
        f.write(b"\x01\x02")
    with pytest.raises(EngineFolderError, match="eagle3.onnx.data: checksum differs"):
        verify(broken)
    with pytest.raises(EngineFolderError, match="not a bundle"):
        verify(tiny_engine)


def test_bundle_bad_input(tiny_heads_engine, eagle3_bundle, tmp_path):
    result = CliRunner().invoke(main, ["bundle", str(tiny_heads_engine), str(tmp_path / "b"),
                                       "--methods", "eagle3,medusa"])
    assert result.exit_code != 0 and "methods ['medusa'] are not in" in result.output
    result = CliRunner().invoke(main, ["bundle", str(tiny_heads_engine), str(eagle3_bundle)])
    assert result.exit_code != 0 and "exists" in result.output
    assert not (tmp_path / "b").exists()


def test_doctor(eagle3_bundle):
    result = CliRunner().invoke(main, ["doctor", "--engine", str(eagle3_bundle), "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    m, e = report["machine"], report["engine"]
    assert "CPUExecutionProvider" in m["ort_providers"] and m["threads"] >= 1
    assert e["runs_here"] and e["bundle"] and e["methods"] == ["none", "ngram", "suffix", "eagle3", "hybrid", "auto"]
    text = CliRunner().invoke(main, ["doctor", "--engine", str(eagle3_bundle)]).output
    assert "threads in use" in text and "runs here" in text


@pytest.mark.slow
def test_runtime_only_install_generates_from_a_bundle(eagle3_bundle, tmp_path):
    """A clean venv, `pip install` of this project without extras: no torch, no transformers;
    `trt-spec generate`, `trt-spec verify` and `trt-spec serve` run on the bundle."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip = subprocess.run([str(venv / "bin" / "pip"), "install", "-q", str(REPO)],
                         capture_output=True, text=True, timeout=900)
    assert pip.returncode == 0, pip.stderr[-3000:]
    python, cli = str(venv / "bin" / "python"), str(venv / "bin" / "trt-spec")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    for banned in ("torch", "transformers", "onnx"):
        r = subprocess.run([python, "-c", f"import {banned}"], capture_output=True, env=env,
                           cwd=tmp_path)
        assert r.returncode != 0, f"{banned} is importable in the runtime-only venv"
    r = subprocess.run([cli, "generate", "--engine", str(eagle3_bundle), "--method", "eagle3",
                        "--max-tokens", "8", "--json", "--no-chat", "a b c"],
                       capture_output=True, text=True, env=env, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert len(json.loads(r.stdout)["token_ids"]) >= 1
    r = subprocess.run([cli, "verify", str(eagle3_bundle)], capture_output=True, text=True,
                       env=env, cwd=tmp_path)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stdout + r.stderr
    server = start_server(eagle3_bundle, cli=[cli], env=env)
    try:
        reply = httpx.post(f"{server.url}/v1/completions", timeout=60, json={
            "model": "tiny", "prompt": "a b c", "max_tokens": 6, "temperature": 0,
            "speculative": {"method": "eagle3"}}).json()
        assert reply["choices"][0]["finish_reason"] in ("stop", "length"), reply
        assert reply["metrics"]["method"] == "eagle3"
    finally:
        assert server.stop() == 0
