"""scripts/gpu_reference.py and scripts/gpu_check.py on the CPU (--device cpu, tiny model, random
heads): every code path the GPU run takes except CUDA-graph capture itself, so the one GPU run
is right the first time."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tiny_models(tiny_hf_dir, tmp_path_factory):
    """The tiny model, its random drafters (own format) and a 2-prompt CPU reference."""
    from tests.random_drafters import eagle3_tensors, random_mtp, write_checkpoint
    from trt_spec.export.checkpoint import load_target
    from trt_spec.export.drafter_checkpoint import save_drafter

    root = tmp_path_factory.mktemp("gpu-check")
    target, config = load_target(tiny_hf_dir)
    save_drafter(random_mtp(target, 2, seed=11), root / "mtp")
    save_drafter(random_mtp(target, 1, seed=12, kind="eagle"), root / "eagle")
    tensors, hf = eagle3_tensors(config, seed=13)
    write_checkpoint(root / "eagle3", tensors, hf)
    prompts = root / "prompts.jsonl"
    prompts.write_text('{"prompt": "hello world"}\n{"prompt": "the cat"}\n')
    subprocess.run([sys.executable, str(ROOT / "scripts/gpu_reference.py"), "--model",
                    str(tiny_hf_dir), "--out", str(root / "ref.json"), "--prompts-file",
                    str(prompts), "--max-new-tokens", "12"], check=True, capture_output=True)
    return root


def gpu_check(*args: str) -> tuple[int, dict, str]:
    out = Path(args[args.index("--out") + 1])
    p = subprocess.run([sys.executable, str(ROOT / "scripts/gpu_check.py"), "--device", "cpu",
                        *args], capture_output=True, text=True, timeout=600)
    return p.returncode, json.loads((out / "gpu_check.json").read_text()), p.stdout


def test_reference_file(tiny_models, tiny_hf_dir):
    ref = json.loads((tiny_models / "ref.json").read_text())
    assert ref["precision"] == "fp32" and ref["config"]["vocab_size"] == 128
    assert [len(i["output_ids"]) for i in ref["items"]] == [12, 12]


def test_every_section_on_cpu(tiny_models, tiny_hf_dir, tmp_path):
    rc, res, stdout = gpu_check(
        "--model", str(tiny_hf_dir), "--reference", str(tiny_models / "ref.json"),
        "--out", str(tmp_path), "--draft-layers", "2", "--speed-tokens", "6",
        *[a for k in ("mtp", "eagle", "eagle3") for a in (f"--{k}", str(tiny_models / k))])
    sections = res["sections"]
    assert rc == 0, stdout
    assert all(s["ok"] for s in sections.values()), sections
    assert sections["reference"]["violations"] == 0 and sections["reference"]["positions"] == 24
    methods = sections["methods"]
    assert {"none", "ngram", "vanilla", "mtp", "eagle", "eagle3"} <= set(methods)
    for m in ("none", "ngram", "vanilla", "mtp", "eagle", "eagle3"):
        assert methods[m]["identical_to_reference"] == 2, (m, methods[m])
    runs = sections["device_loop"]["runs"]  # the device loop, every method, batch 1 and 8
    for m in ("none", "ngram", "vanilla", "mtp", "eagle", "eagle3"):
        for batch in (1, 8):
            assert runs[f"device/{m}/batch{batch}"]["tokens_per_s"] > 0, (m, batch, runs)
    assert runs["host/none/batch8"]["tokens_per_s"] > 0 and runs["device/mtp/batch1"]["speedup"]
    assert json.loads((tmp_path / "device_loop.json").read_text())["runs"].keys() == runs.keys()
    plot = sections["device_loop"]["plot"]
    assert plot.endswith(("device_loop.png", "device_loop.svg")) and Path(plot).exists()
    speed = sections["speed"]
    assert {"none/batch1/graphs", "none/batch8/eager", "eagle3/batch8/graphs"} <= set(speed)
    assert "speedup" in " ".join(speed)
    assert "skipped" in sections["tensorrt"]  # no tensorrt here
    assert "[gpu_check" in stdout  # progress lines


def test_a_failing_section_does_not_stop_the_rest(tiny_models, tiny_hf_dir, tmp_path):
    rc, res, _ = gpu_check("--model", str(tiny_hf_dir), "--reference",
                           str(tiny_models / "ref.json"), "--out", str(tmp_path),
                           "--eagle3", str(tmp_path / "missing"))
    sections = res["sections"]
    assert rc == 1
    assert sections["load"]["ok"] is False and "missing" in sections["load"]["error"]
    assert sections["environment"]["ok"] and sections["tensorrt"]["ok"]  # ran after it
