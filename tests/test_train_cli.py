"""`trt-spec train` on the tiny target: a run, a resumed run, and its errors."""

import json

import pytest
from click.testing import CliRunner

from tests.train_data import sharegpt_records, write_sharegpt
from trt_spec.cli import main


def test_train_help():
    result = CliRunner().invoke(main, ["train", "--help"])
    assert result.exit_code == 0 and "--draft-vocab" in result.output and "--resume" in result.output


@pytest.fixture
def args(tiny_hf_dir, tmp_path):
    data = write_sharegpt(tmp_path / "d.json", sharegpt_records(40))
    return ["train", "--method", "eagle3", "--model", str(tiny_hf_dir), "--data", str(data),
            "--out", str(tmp_path / "run"), "--max-tokens", "400", "--max-len", "48",
            "--epochs", "2", "--draft-vocab", "48", "--batch-size", "4", "--top-k", "8"]


def test_train_then_resume_then_export(args, tmp_path):
    result = CliRunner().invoke(main, args + ["--max-steps", "2"])
    assert result.exit_code == 0, result.output
    first = json.loads(result.stdout)["eagle3"]
    assert first["step"] == 2 and not first["done"]
    assert "features: shard" in result.stderr and "train: step 1/" in result.stderr
    again = CliRunner().invoke(main, args)
    assert again.exit_code != 0 and "pass --resume" in again.output
    resumed = CliRunner().invoke(main, args + ["--resume"])
    assert resumed.exit_code == 0, resumed.output
    done = json.loads(resumed.stdout)["eagle3"]
    assert done["done"] and done["step"] == done["total_steps"] > 2
    assert "skipped_shards" in resumed.stderr and "features: shard" not in resumed.stderr
    export = CliRunner().invoke(main, ["export", "--model", args[4], "--precision", "fp32",
                                       "--out", str(tmp_path / "engine"),
                                       "--eagle3", done["drafter"]])
    assert export.exit_code == 0, export.output
    gen = CliRunner().invoke(main, ["generate", "--engine", str(tmp_path / "engine"), "--method",
                                    "eagle3", "--max-tokens", "8", "--json", "a b c"])
    assert gen.exit_code == 0, gen.output
    assert json.loads(gen.stdout)["metrics"]["proposed_tokens"] > 0


@pytest.mark.parametrize("extra, message", [
    (["--device", "cuda"], "--device cuda: torch sees no CUDA device"),
    (["--draft-vocab", "500"], "draft vocabulary size 500: must be in 1..128"),
    (["--epochs", "0"], "Invalid value for '--epochs'"),
])
def test_train_errors_say_what_is_allowed(args, extra, message):
    import torch

    if "cuda" in extra and torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    result = CliRunner().invoke(main, args + extra)
    assert result.exit_code != 0 and message in result.output, result.output


def test_train_missing_data(args):
    i = args.index("--data")
    result = CliRunner().invoke(main, args[:i + 1] + ["/nonexistent.json"] + args[i + 2:])
    assert result.exit_code != 0 and "/nonexistent.json" in result.output


def test_train_mtp_from_the_cli(args, tmp_path):
    i = args.index("eagle3")
    mtp = args[:i] + ["mtp"] + args[i + 1:] + ["--num-modules", "2", "--max-steps", "3",
                                                "--heldout-tokens", "0"]
    result = CliRunner().invoke(main, mtp)
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)["mtp"]
    assert out["step"] == 3 and set(out) >= {"loss_0", "loss_1", "acc_1"}
    assert (tmp_path / "run" / "mtp" / "drafter.json").is_file()
