import json

import pytest
from click.testing import CliRunner

from trt_spec.cli import main


@pytest.mark.parametrize("command", [[], ["export"], ["generate"], ["bench"]])
def test_every_command_has_help(command):
    result = CliRunner().invoke(main, command + ["--help"])
    assert result.exit_code == 0 and "Usage:" in result.output


def test_generate_json(tiny_engine):
    result = CliRunner().invoke(main, ["generate", "--engine", str(tiny_engine), "--max-tokens",
                                       "5", "--json", "--no-chat", "a b c"])
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    assert set(out) == {"text", "token_ids", "finish_reason", "metrics"}
    assert 1 <= len(out["token_ids"]) <= 5
    assert out["metrics"]["prompt_tokens"] == 3


def test_generate_plain_prints_answer_and_rate(tiny_engine):
    result = CliRunner().invoke(main, ["generate", "--engine", str(tiny_engine), "--max-tokens",
                                       "4", "--temperature", "0.8", "--seed", "1", "a b"])
    assert result.exit_code == 0, result.output
    assert "tokens/s decode" in result.stderr


@pytest.mark.parametrize("args, message", [
    (["--top-p", "0"], "Invalid value for '--top-p'"),
    (["--temperature", "-1"], "Invalid value for '--temperature'"),
    (["--max-tokens", "0"], "Invalid value for '--max-tokens'"),
    (["--method", "eagle9"], "method 'eagle9' is not available"),
    (["--engine", "/no/such/folder"], "'/no/such/folder' does not exist"),
])
def test_generate_bad_input(tiny_engine, args, message):
    base = ["generate", "--engine", str(tiny_engine)]
    result = CliRunner().invoke(main, base + args + ["hello"])
    assert result.exit_code != 0 and message in result.output


def test_export_refuses_unknown_model(tmp_path):
    result = CliRunner().invoke(main, ["export", "--model", "gpt-17", "--out", str(tmp_path / "x")])
    assert result.exit_code != 0 and "'gpt-17' is not a known name" in result.output


def test_bench_runs(tiny_engine, tmp_path):
    out = tmp_path / "b.json"
    result = CliRunner().invoke(main, ["bench", "--engine", str(tiny_engine), "--max-tokens", "8",
                                       "--prompts", "2", "--past", "0,16", "--repeats", "1",
                                       "--json", str(out)])
    assert result.exit_code == 0, result.output
    report = json.loads(out.read_text())
    assert {r["workload"] for r in report["results"]} == {"chat", "past=0", "past=16"}
    assert all(r["decode_tokens_per_s_median"] > 0 for r in report["results"])
