"""train/curve.py and train/scan.py on the tiny target: the learning curve is written every
eval_every tokens, resumes without duplicates and does not change training; the τ estimate
counts chains, not marginals; the scan keeps the best run and skips finished ones; bad
option values say what is allowed."""

import dataclasses
import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from tests.script_util import load_script
from tests.train_data import sharegpt_records, write_sharegpt
from trt_spec.cli import main
from trt_spec.export.checkpoint import load_target
from trt_spec.export.drafter_checkpoint import load_drafter
from trt_spec.export.sharegpt import load_tokenizer, read_conversations
from trt_spec.train.curve import chain_accept, read_curve, tau_estimate
from trt_spec.train.data import tokenize_all
from trt_spec.train.eagle3 import train_eagle3
from trt_spec.train.features import FeatureConfig, FeatureStore, extract
from trt_spec.train.loop import (RunControl, TrainConfig, batch_indices, lr_factor, tokens_before,
                                 total_steps)


@pytest.fixture(scope="module")
def target(tiny_hf_dir):
    return load_target(tiny_hf_dir)[0]


def features(target, tiny_hf_dir, folder, seed):
    path = write_sharegpt(folder / "d.json", sharegpt_records(16, seed=seed))
    convs, _ = read_conversations(path)
    examples = tokenize_all(load_tokenizer(tiny_hf_dir), convs, max_len=64)
    extract(target, examples, folder / "f", FeatureConfig(top_k=16, shard_tokens=300), "tiny")
    return FeatureStore(folder / "f")


@pytest.fixture(scope="module")
def store(target, tiny_hf_dir, tmp_path_factory):
    return features(target, tiny_hf_dir, tmp_path_factory.mktemp("train"), seed=0)


@pytest.fixture(scope="module")
def heldout(target, tiny_hf_dir, tmp_path_factory):
    return features(target, tiny_hf_dir, tmp_path_factory.mktemp("heldout"), seed=9)


def config_for(store) -> TrainConfig:
    # ~3 records per epoch; 4 steps per epoch, 12 in all; the state every 4 steps
    return TrainConfig(epochs=3, batch_size=4, lr=3e-3, warmup_steps=2, checkpoint_every=4,
                       ttt_steps=2, eval_every=store.tokens // 3, eval_sequences=8)


@pytest.fixture(scope="module")
def clean(target, store, heldout, tmp_path_factory):
    out = tmp_path_factory.mktemp("clean")
    metrics = train_eagle3(store, target, out, config_for(store), 48, heldout=heldout)
    return out, metrics


def expected_records(store, config):
    """(step, tokens seen) of every record: step 0, each step whose batch crosses a multiple
    of eval_every, and the last step."""
    lengths = [len(store[i].input_ids) for i in range(len(store))]
    total = total_steps(len(store), config)
    seen, out = 0, [(0, 0)]
    for step in range(1, total + 1):
        before = seen
        seen += sum(lengths[i] for i in batch_indices(len(store), step - 1, config))
        if seen // config.eval_every > before // config.eval_every or step == total:
            out.append((step, seen))
    return out


def test_curve_records_every_eval_every_tokens(store, clean):
    out, metrics = clean
    config = config_for(store)
    records = read_curve(out / "eagle3-curve.jsonl")
    expected = expected_records(store, config)
    assert [(r["step"], r["tokens_seen"]) for r in records] == expected
    assert len(expected) >= 6 and metrics["tokens_seen"] == expected[-1][1]
    assert records[0]["train_loss"] is None and all(r["train_loss"] > 0 for r in records[1:])
    total = total_steps(len(store), config)
    for r in records:
        assert r["epoch"] == pytest.approx(r["step"] / 4)
        assert r["lr"] == pytest.approx(config.lr * lr_factor(max(r["step"] - 1, 0), total, config))
        assert len(r["acc"]) == len(r["accept"]) == r["k"] == 4  # ttt 2, evaluated to k = 4
        assert all(a >= b for a, b in zip(r["accept"], r["accept"][1:]))  # chains only shorten
        assert r["tau_est"] == pytest.approx(1 + sum(r["accept"])) and 1 <= r["tau_est"] <= 5
    assert [r["seconds"] for r in records] == sorted(r["seconds"] for r in records)


def test_resume_continues_the_curve_without_duplicates(target, store, heldout, clean, tmp_path):
    config = config_for(store)

    def killed_at_step_7(log):
        if log.step == 7:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        train_eagle3(store, target, tmp_path, config, 48, RunControl(log=killed_at_step_7),
                     heldout=heldout)
    state = torch.load(tmp_path / "eagle3-state.pt", weights_only=False)
    assert state["step"] == 4 and state["tokens_seen"] == tokens_before(store, 4, config)
    assert max(r["step"] for r in read_curve(tmp_path / "eagle3-curve.jsonl")) > 4
    # eval_every is not a training setting: a resumed run may change it (here: not)
    train_eagle3(store, target, tmp_path, config, 48, RunControl(resume=True), heldout=heldout)
    resumed = read_curve(tmp_path / "eagle3-curve.jsonl")
    reference = read_curve(clean[0] / "eagle3-curve.jsonl")
    assert [r["step"] for r in resumed] == [r["step"] for r in reference]  # none twice
    for a, b in zip(resumed, reference):
        assert a["tokens_seen"] == b["tokens_seen"] and a["epoch"] == b["epoch"]
        np.testing.assert_allclose(a["acc"] + a["accept"], b["acc"] + b["accept"], atol=1e-6)


def test_the_curve_does_not_change_training(target, store, clean, tmp_path):
    plain = dataclasses.replace(config_for(store), eval_every=0)
    train_eagle3(store, target, tmp_path, plain, 48)
    assert not (tmp_path / "eagle3-curve.jsonl").exists()
    a = load_drafter(clean[0] / "eagle3", "eagle3", target)
    b = load_drafter(tmp_path / "eagle3", "eagle3", target)
    for (name, x), (_, y) in zip(a.modules[0].state_dict().items(),
                                 b.modules[0].state_dict().items()):
        torch.testing.assert_close(x, y, rtol=0, atol=0, msg=name)


def test_tokens_seen_of_an_older_state_is_recomputed(store):
    config = config_for(store)
    lengths = [len(store[i].input_ids) for i in range(len(store))]
    by_hand = sum(lengths[i] for s in range(6) for i in batch_indices(len(store), s, config))
    assert tokens_before(store, 6, config) == by_hand


@pytest.mark.parametrize("kind, modules, steps", [("mtp", 2, 4), ("eagle", 1, 4),
                                                   ("draft", None, 1)])
def test_every_method_writes_a_curve(target, store, heldout, tmp_path, kind, modules, steps):
    from trt_spec.train.draft import train_draft
    from trt_spec.train.mtp import train_mtp

    config = dataclasses.replace(config_for(store), eval_every=10 ** 9)  # step 0 and the end
    if kind == "draft":
        train_draft(store, target, tmp_path, config, (0,), RunControl(max_steps=2), heldout)
    else:
        train_mtp(store, target, tmp_path, config, kind, modules or 1, RunControl(max_steps=2),
                  heldout=heldout)
    records = read_curve(tmp_path / f"{kind}-curve.jsonl")
    assert [r["step"] for r in records] == [0]  # stopped before the end: no second record
    assert len(records[0]["acc"]) == steps and len(records[0]["accept"]) == 4


def test_tau_counts_chains_not_marginals():
    assert tau_estimate([0.8, 0.6, 0.4, 0.2]) == pytest.approx(3.0)
    assert tau_estimate([1.0] * 6) == 5.0 and tau_estimate([]) == 1.0  # k = 4 drafts at most
    # 4 anchors, 3 steps; anchor 3 runs past the text at step 2 (not an anchor)
    hit = torch.tensor([[[1, 1, 0, 1]], [[0, 1, 1, 1]], [[1, 1, 1, 1]]], dtype=torch.bool)
    valid = torch.tensor([[[1, 1, 1, 1]], [[1, 1, 1, 1]], [[1, 1, 1, 0]]], dtype=torch.bool)
    accept = chain_accept(list(zip(hit, valid)))
    # anchors 0..2: step 0 hits {0, 1}; steps 0-1 hit {1}; steps 0-2 hit {1}
    assert accept == pytest.approx({"accept_0": 2 / 3, "accept_1": 1 / 3, "accept_2": 1 / 3})
    marginals = [2 / 3, 2 / 3, 1.0]  # step 1 hits anchor 2 after a miss: no chain counts it
    assert 1 + sum(np.cumprod(marginals)) != pytest.approx(1 + sum(accept.values()))


# --- the scan and the CLI ---------------------------------------------------------------


@pytest.fixture
def args(tiny_hf_dir, tmp_path):
    data = write_sharegpt(tmp_path / "d.json", sharegpt_records(40))
    return ["train", "--method", "eagle3", "--model", str(tiny_hf_dir), "--data", str(data),
            "--out", str(tmp_path / "run"), "--max-tokens", "400", "--max-len", "48",
            "--draft-vocab", "48", "--batch-size", "4", "--top-k", "8"]


def test_scan_keeps_the_best_and_skips_finished_runs(args, tmp_path):
    scan = args + ["--lr-scan", "1e-5,3e-3", "--scan-tokens", "800"]
    first = CliRunner().invoke(main, scan + ["--scan-only"])
    assert first.exit_code == 0, first.output
    table = json.loads((tmp_path / "run" / "scan.json").read_text())["eagle3"]
    runs = table["runs"]
    assert [r["lr"] for r in runs] == [1e-5, 3e-3] and all(r["steps"] > 4 for r in runs)
    top = max(runs, key=lambda r: (r["acc"][0], r["acc_mean"]))
    assert table["best"] == {"lr": top["lr"], "warmup": 20}
    assert "scan eagle3: 800 tokens per run" in first.stderr
    assert json.loads(first.stdout)["eagle3"]["scan"]["best"] == table["best"]
    assert not (tmp_path / "run" / "eagle3-state.pt").exists()  # --scan-only: no full run
    results = sorted((tmp_path / "run" / "scan").glob("*/result.json"))
    assert [p.parent.name for p in results] == ["eagle3-lr0.003-wu20", "eagle3-lr1e-05-wu20"]
    stamps = [p.stat().st_mtime_ns for p in results]
    again = CliRunner().invoke(main, scan + ["--max-steps", "2", "--eval-every", "100"])
    assert again.exit_code == 0, again.output
    assert again.stderr.count("(done before)") == 2
    assert [p.stat().st_mtime_ns for p in results] == stamps
    done = json.loads(again.stdout)["eagle3"]
    assert done["lr"] == top["lr"] and done["step"] == 2
    curve = read_curve(tmp_path / "run" / "eagle3-curve.jsonl")
    assert [r["step"] for r in curve][0] == 0 and curve[-1]["tokens_seen"] >= 100


def test_two_warmups_that_run_the_same_schedule_are_an_error(args):
    result = CliRunner().invoke(main, args + ["--warmup-scan", "50,100", "--scan-tokens",
                                              "400", "--scan-only"])
    assert result.exit_code != 0
    assert "so 50 and 100 run the same schedule; raise --scan-tokens" in result.output


def test_the_cli_writes_the_curve(args, tmp_path):
    result = CliRunner().invoke(main, args + ["--eval-every", "100", "--max-steps", "3"])
    assert result.exit_code == 0, result.output
    curve = read_curve(tmp_path / "run" / "eagle3-curve.jsonl")
    assert curve[0]["step"] == 0 and len(curve) >= 2 and curve[-1]["tokens_seen"] >= 100
    assert f"held-out at {curve[1]['tokens_seen']} tokens: acc by step" in result.stderr


@pytest.mark.parametrize("extra, message", [
    (["--eval-every", "ten"], "'ten': expected a whole number of tokens >= 0, e.g. 50000"),
    (["--eval-every", "-5"], "'-5': expected a whole number of tokens >= 0"),
    (["--eval-sequences", "0"], "Invalid value for '--eval-sequences'"),
    (["--eval-every", "1k", "--heldout-tokens", "0"], "--eval-every evaluates on held-out data"),
    (["--lr-scan", "1e-3,0"], "'1e-3,0': expected comma-separated learning rates > 0"),
    (["--lr-scan", "fast"], "'fast': expected comma-separated learning rates > 0"),
    (["--warmup-scan", "20,-1"], "'20,-1': expected comma-separated warm-up steps >= 0"),
    (["--scan-tokens", "0"], "'0': expected a whole number of tokens >= 1"),
    (["--lr-scan", "1e-3"], "give --scan-tokens"),
    (["--scan-only"], "--scan-tokens / --scan-only go with --lr-scan or --warmup-scan"),
    (["--lr-scan", "1e-3", "--scan-tokens", "5k", "--heldout-tokens", "0"],
     "a scan evaluates on held-out data"),
])
def test_bad_curve_and_scan_options_say_what_is_allowed(args, extra, message):
    result = CliRunner().invoke(main, args + extra)
    assert result.exit_code != 0 and message in result.output, result.output


def test_scan_best_breaks_ties_by_mean_accuracy():
    from trt_spec.train.scan import best

    runs = [{"lr": 1, "acc": [0.5, 0.1], "acc_mean": 0.3},
            {"lr": 2, "acc": [0.5, 0.3], "acc_mean": 0.4},
            {"lr": 3, "acc": [0.4, 0.9], "acc_mean": 0.65},
            {"lr": 4, "acc": [0.5, 0.3], "acc_mean": 0.4}]
    assert best(runs)["lr"] == 2  # acc_0 first, then the mean, then the first of equals


def load_plot_script():
    return load_script("plot_curve")


def test_plot_curve(clean, tmp_path):
    pytest.importorskip("matplotlib")
    plot_curve = load_plot_script()
    curve = clean[0] / "eagle3-curve.jsonl"
    png = tmp_path / "img" / "curve.png"
    assert plot_curve.main([str(curve), str(curve), "--out", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert plot_curve.label(curve, [curve, tmp_path / "eagle3-curve.jsonl"]).endswith("/eagle3")
    with pytest.raises(SystemExit):
        plot_curve.main([str(tmp_path / "missing.jsonl"), "--out", str(png)])


def test_plot_curve_without_matplotlib(clean, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    plot_curve = load_plot_script()
    with pytest.raises(SystemExit, match="needs matplotlib: pip install -e '.\\[bench\\]'"):
        plot_curve.main([str(clean[0] / "eagle3-curve.jsonl"), "--out", str(tmp_path / "c.png")])
