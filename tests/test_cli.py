import json
import subprocess
import sys

import pytest
from click.testing import CliRunner

from trt_spec.cli import main


@pytest.mark.parametrize("command", [[], ["export"], ["generate"], ["bench"], ["fidelity"],
                                     ["bundle"], ["verify"], ["doctor"], ["serve"], ["train"],
                                     ["build"]])
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


def test_generate_takes_the_sampling_controls(tiny_engine):
    """--logit-bias, --min-p and the penalties reach SamplingParams: a bias of 100 makes a
    token certain, even sampled."""
    base = ["generate", "--engine", str(tiny_engine), "--max-tokens", "6", "--json", "--no-chat",
            "--temperature", "0.9", "--seed", "2", "--min-p", "0.05", "--presence-penalty",
            "0.5", "--frequency-penalty", "0.2", "--repetition-penalty", "1.1"]
    result = CliRunner().invoke(main, base + ["--logit-bias", "7=100", "a b c"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["token_ids"] == [7] * 6
    result = CliRunner().invoke(main, base + ["a b c"])
    assert result.exit_code == 0 and json.loads(result.stdout)["token_ids"] != [7] * 6


def test_generate_plain_prints_answer_and_rate(tiny_engine):
    result = CliRunner().invoke(main, ["generate", "--engine", str(tiny_engine), "--max-tokens",
                                       "4", "--temperature", "0.8", "--seed", "1", "a b"])
    assert result.exit_code == 0, result.output
    assert "tokens/s decode" in result.stderr


@pytest.mark.parametrize("args, message", [
    (["--top-p", "0"], "Invalid value for '--top-p'"),
    (["--temperature", "-1"], "Invalid value for '--temperature'"),
    (["--max-tokens", "0"], "Invalid value for '--max-tokens'"),
    (["--method", "eagle9"], "method 'eagle9' is not known"),
    (["--method", "vanilla"], "has no vanilla draft"),
    (["--method", "eagle3"], "has no eagle3 drafter (export it with --eagle3 CHECKPOINT)"),
    (["--num-draft-tokens", "0"], "Invalid value for '--num-draft-tokens'"),
    (["--logit-bias", "5:1"], "'5:1': expected ID=BIAS"),
    (["--logit-bias", "5=101"], "logit_bias[5]=101.0: must be a finite number in -100..100"),
    (["--logit-bias", "500=1"], "logit_bias has token ids [500] outside the vocabulary 0..127"),
    (["--presence-penalty", "3"], "presence_penalty=3.0: must be a finite number in -2..2"),
    (["--min-p", "2"], "min_p=2.0: must be a finite number in 0..1"),
    (["--engine", "/no/such/folder"], "'/no/such/folder' does not exist"),
])
def test_generate_bad_input(tiny_engine, args, message):
    base = ["generate", "--engine", str(tiny_engine)]
    result = CliRunner().invoke(main, base + args + ["hello"])
    assert result.exit_code != 0 and message in result.output


def test_export_refuses_unknown_model(tmp_path):
    result = CliRunner().invoke(main, ["export", "--model", "gpt-17", "--out", str(tmp_path / "x")])
    assert result.exit_code != 0 and "'gpt-17' is not a known name" in result.output


def test_bench_runs(tiny_spec_engine, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "a b c"}\n{"messages": [{"role": "user", "content": "d e"}]}\n')
    out = tmp_path / "b.json"
    result = CliRunner().invoke(main, ["bench", "--engine", str(tiny_spec_engine), "--prompts",
                                       str(prompts), "--methods", "vanilla,ngram",
                                       "--num-draft-tokens", "2,4", "--max-new-tokens", "8",
                                       "--past", "16", "--repeats", "1", "--json", str(out)])
    assert result.exit_code == 0, result.output
    report = json.loads(out.read_text())
    assert set(report) == {"settings", "machine", "step_costs_ms", "results"}
    costs = report["step_costs_ms"][str(tiny_spec_engine)]
    assert set(costs["ms"]) == {"1", "2", "3", "4", "5"}
    assert all(v > 0 for v in costs["ms"].values())
    got = {(r["method"], r["num_draft_tokens"], r["workload"]) for r in report["results"]}
    assert got == {(m, k, w) for m, k in [("none", None), ("none-fast", None), ("vanilla", 2),
                                          ("vanilla", 4), ("ngram", 2), ("ngram", 4)]
                   for w in ("prompts", "past=16")}
    for r in report["results"]:
        assert r["tokens_per_s"]["median"] > 0 and len(r["tokens_per_s"]["runs"]) >= 1
        assert r["tau"] >= 1.0 and r["speedup_vs_none_fast"] > 0
        # steps by the number of tokens they drafted
        assert sum(r["drafted_k_histogram"]) == r["decode_steps"]
        if r["method"] not in ("none", "none-fast"):
            assert r["identical_to_baseline"] == 1.0  # greedy on an fp32 graph: lossless
        if r["method"] not in ("none", "none-fast") and r["workload"] == "prompts":  # predicted
            # (a run whose policy found drafting did not pay may have drafted nothing)
            k, ms = r["num_draft_tokens"], costs["ms"]
            drafted = r["drafted_per_position"] + [0] * (k + 1)
            # steps that drafted exactly j tokens weigh c(j + 1)
            counts = [r["decode_steps"] - drafted[0]] + [
                drafted[j - 1] - (drafted[j] if j < len(drafted) else 0) for j in range(1, k + 1)]
            assert sum(counts) == r["decode_steps"] and min(counts) >= 0
            want = sum(n * ms[str(j + 1)] for j, n in enumerate(counts)) / sum(counts) / ms["1"]
            assert r["verify_cost_ratio"] == pytest.approx(want)
            assert r["predicted_speedup"] == pytest.approx(
                r["tau"] / (r["verify_cost_ratio"] + r["drafting_cost_ratio"]))
            assert r["speedup_efficiency"] == pytest.approx(
                r["speedup_vs_none"] / r["predicted_speedup"])
            none = next(x for x in report["results"]
                        if x["method"] == "none" and x["workload"] == "prompts")
            step = r["propose_us_per_step"] + r["score_us_per_step"]
            assert r["loop_efficiency"] == pytest.approx(
                r["speedup_vs_none"] * step / (r["tau"] * none["score_us_per_step"]))
        else:
            assert "predicted_speedup" not in r
    assert "tok/s" in result.stdout and "predicted" in result.stdout


def test_bench_sizes_its_context_to_the_longest_prompt(tiny_engine, monkeypatch):
    """A prompt past the 512 tokens bench used to allow for is benched, not refused midway:
    each generator is asked for a context that holds it and its answer (a model's own
    positions then bound it, the tiny one's 256)."""
    from trt_spec.tools import bench
    from trt_spec.tools.bench_config import BenchConfig

    prompts = ["a b c", [{"role": "user", "content": "x " * 700}]]
    longest = bench.longest_prompt(str(tiny_engine), prompts)
    assert longest > 700
    asked = []

    def generator(engine, **kw):
        asked.append(kw["max_len"])
        raise RuntimeError("asked")

    monkeypatch.setattr(bench, "Generator", generator)
    with pytest.raises(RuntimeError, match="asked"):
        bench.load_engines(BenchConfig(engines=(str(tiny_engine),), max_new_tokens=8), ["none"],
                           [4], prompts)
    assert asked == [longest + 8 + 4 + 8]  # the prompt, its 8 tokens, k 4, 8 spare


def test_bench_batch_throughput(tiny_spec_engine, tmp_path):
    out = tmp_path / "b.json"
    result = CliRunner().invoke(main, ["bench", "--engine", str(tiny_spec_engine), "--methods",
                                       "ngram", "--num-draft-tokens", "2", "--batch", "3",
                                       "--max-new-tokens", "6", "--repeats", "1", "--json",
                                       str(out)])
    assert result.exit_code == 0, result.output
    report = json.loads(out.read_text())
    assert report["settings"]["batch"] == 3
    for r in report["results"]:
        assert len(r["tokens_per_s"]["runs"]) == 9  # 8 default prompts in 3 groups of 3
        assert r["throughput_tokens_per_s"] > 0
        if r["method"] == "ngram":
            assert r["identical_to_baseline"] == 1.0


@pytest.mark.parametrize("args, message", [
    (["--methods", "medusa"], "method 'medusa' is not known"),
    (["--num-draft-tokens", "0"], "num_draft_tokens=0: must be an integer in 1..64, or auto"),
    (["--prompts", "/no/file.jsonl"], "no such file"),
])
def test_bench_bad_input(tiny_engine, args, message):
    result = CliRunner().invoke(main, ["bench", "--engine", str(tiny_engine)] + args)
    assert result.exit_code != 0 and message in result.output


def test_fidelity_of_an_engine_to_itself(tiny_engine):
    result = CliRunner().invoke(main, ["fidelity", "--reference", str(tiny_engine), "--engine",
                                       str(tiny_engine), "--max-new-tokens", "4"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["greedy_agreement"] == 1.0 and report["mean_kl"] < 1e-9
    assert report["positions"] == 8 * 4


def test_export_and_generate_with_heads(tiny_hf_dir, tmp_path):
    """`trt-spec export --eagle3 --mtp` from published layouts, then every method generates
    the plain greedy text."""
    from tests.random_drafters import eagle3_tensors, mtp_tensors, write_checkpoint
    from trt_spec.export.checkpoint import config_from_hf

    config = config_from_hf(json.loads((tiny_hf_dir / "config.json").read_text()))
    write_checkpoint(tmp_path / "e3", *eagle3_tensors(config, seed=1, layout="model"))
    write_checkpoint(tmp_path / "mtp", *mtp_tensors(config, seed=2, n=2))
    out = tmp_path / "engine"
    result = CliRunner().invoke(main, ["export", "--model", str(tiny_hf_dir), "--precision",
                                       "int4", "--out", str(out), "--eagle3", str(tmp_path / "e3"),
                                       "--mtp", str(tmp_path / "mtp")])
    assert result.exit_code == 0, result.output
    texts = {}
    for method in ("none", "mtp", "eagle3"):
        result = CliRunner().invoke(main, ["generate", "--engine", str(out), "--method", method,
                                           "--max-tokens", "12", "--json", "--no-chat", "a b c"])
        assert result.exit_code == 0, result.output
        out_json = json.loads(result.stdout)
        texts[method] = out_json["token_ids"]
        if method != "none":
            assert out_json["metrics"]["proposed_tokens"] > 0
    assert texts["mtp"] == texts["none"] == texts["eagle3"]


def test_export_names_a_bad_drafter_key(tiny_hf_dir, tmp_path):
    from tests.random_drafters import eagle3_tensors, write_checkpoint
    from trt_spec.export.checkpoint import config_from_hf

    config = config_from_hf(json.loads((tiny_hf_dir / "config.json").read_text()))
    tensors, hf = eagle3_tensors(config, seed=1)
    del tensors["midlayer.hidden_norm.weight"]
    write_checkpoint(tmp_path / "e3", tensors, hf)
    result = CliRunner().invoke(main, ["export", "--model", str(tiny_hf_dir), "--out",
                                       str(tmp_path / "engine"), "--eagle3", str(tmp_path / "e3")])
    assert result.exit_code != 0
    assert "checkpoint is missing 'midlayer.hidden_norm.weight'" in result.output
    assert not (tmp_path / "engine").exists()  # nothing half-written


def test_serve_ray_without_ray_is_one_clear_line(tiny_engine):
    """The base install has no Ray: `serve --ray` says what to install, in one line."""
    code = ("import sys; sys.modules['ray'] = None  # import ray -> ImportError\n"
            "from trt_spec.cli import main\n"
            f"main(['serve', '--ray', '--engine', {str(tiny_engine)!r}])")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 1
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "pip install 'trt-spec[ray]'" in lines[0], result.stderr


def test_serve_ray_refuses_a_wrong_engine_checksum_before_starting_ray(tiny_engine):
    pytest.importorskip("ray")
    result = CliRunner().invoke(main, ["serve", "--ray", "--engine", str(tiny_engine),
                                       "--engine-checksum", "0" * 64])
    assert result.exit_code == 1 and f"--engine-checksum {'0' * 64}" in result.output


def test_bench_fast_decode_is_recorded(tiny_engine, tmp_path):
    out = tmp_path / "b.json"
    for flag, exact in (([], True), (["--fast-decode"], False)):
        result = CliRunner().invoke(main, ["bench", "--engine", str(tiny_engine),
                                           "--max-new-tokens", "4", "--repeats", "1",
                                           "--num-prompts", "1", "--json", str(out)] + flag)
        assert result.exit_code == 0, result.output
        assert json.loads(out.read_text())["settings"]["exact_decode"] is exact


def test_every_option_has_help():
    import click

    for name, command in main.commands.items():
        assert command.help, name
        for param in command.params:
            if isinstance(param, click.Option):
                assert param.help, f"{name} {param.opts}"


def test_export_lowers_for_a_runtime_and_backend_is_the_runtime_only(tmp_path):
    """`export --lower-for ort|trt`; `--backend` is the runtime backend of generate alone."""
    result = CliRunner().invoke(main, ["export", "--lower-for", "tensorrt", "--out",
                                       str(tmp_path / "x")])
    assert result.exit_code == 2
    assert "'tensorrt' is not one of 'ort', 'trt'" in result.output
    result = CliRunner().invoke(main, ["export", "--backend", "trt", "--out", str(tmp_path / "x")])
    assert result.exit_code == 2 and "export's --backend is now --lower-for ort|trt" in result.output


def test_generate_backend_choices(tiny_engine):
    result = CliRunner().invoke(main, ["generate", "--engine", str(tiny_engine), "--backend",
                                       "cuda", "hi"])
    assert result.exit_code == 2
    assert "'cuda' is not one of 'ort', 'torch-cuda', 'trt'" in result.output
    # trt: accepted here; where the runtime cannot run it, one line saying why
    result = CliRunner().invoke(main, ["generate", "--engine", str(tiny_engine), "--backend",
                                       "trt", "--max-tokens", "2", "hi"])
    if result.exit_code != 0:
        assert result.exit_code == 1 and "trt" in result.output
        assert len(result.output.strip().splitlines()) == 1, result.output


@pytest.mark.parametrize("args, message", [
    (["--methods", "none,medusa"], "Invalid value for '--methods'"),
    (["--num-draft-tokens", "2,x"], "num_draft_tokens='x': must be an integer in 1..64, or auto"),
    (["--past", "-5"], "values must be >= 0"),
    (["--peers", "vllm"], "'vllm' is not a peer; choose from"),
])
def test_bench_usage_errors_quote_the_value(tiny_engine, args, message):
    result = CliRunner().invoke(main, ["bench", "--engine", str(tiny_engine)] + args)
    assert result.exit_code == 2 and message in result.output, result.output


def test_python_m_trt_spec_cli_runs_the_same_group():
    result = subprocess.run([sys.executable, "-m", "trt_spec.cli", "--help"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and "generate" in result.stdout


def test_cli_options_are_config_fields_with_their_defaults():
    """Each command builds its config objects from its options by name, with no renaming in
    between: every option but a command's own few is a field of one of them (by the field's
    name or the public name it declares), and shows that field's default: every default
    lives in one place."""
    import dataclasses

    from trt_spec.cli import main
    from trt_spec.runtime.sampling import SamplingParams
    from trt_spec.runtime.options import option_names
    from trt_spec.runtime.settings import SERVE_MAX_BATCH, RuntimeConfig, SpeculationConfig
    from trt_spec.serve.options import RayOptions, ServeOptions
    from trt_spec.tools.bench_config import BenchConfig

    def fields(*classes):  # public name -> default (MISSING: none)
        return {public: next(f for f in dataclasses.fields(c) if f.name == name).default
                for c in classes for public, name in option_names(c).items()}

    runtime = fields(RuntimeConfig, SpeculationConfig)
    commands = {  # the configs each command builds; its own options; its own defaults
        "generate": (fields(SamplingParams) | runtime, {"engine", "chat", "as_json", "prompt"},
                     {}),
        "serve": (fields(ServeOptions, RayOptions) | runtime, {"engine", "use_ray",
                                                                 "engine_checksum"},
                  {"max_num_seqs": SERVE_MAX_BATCH, "cost_cache": True,
                   "method": None}),  # method: auto where the folder has drafters
        "bench": (fields(BenchConfig), {"step_costs", "overhead", "json_out", "plot_out"}, {}),
    }
    wrong = []
    for name, (known, own, differs) in commands.items():
        command = main.commands[name]  # the options' values when none is given
        params = command.make_context(name, ["PROMPT"] if name == "generate" else []).params
        assert not set(params) - set(known) - own, (name, set(params) - set(known) - own)
        for option, default in params.items():
            if option in own or known[option] is dataclasses.MISSING:
                continue
            want = differs.get(option, known[option])
            if option == "num_draft_tokens":  # parsed: DraftTokens(k, adaptive)
                default = default.k
            if isinstance(default, list):
                default = tuple(default)
            if default != want:
                wrong.append((name, option, default, want))
    assert not wrong, wrong
    assert BenchConfig.max_new_tokens == SamplingParams.max_tokens
    assert BenchConfig.ks == (SpeculationConfig.num_draft_tokens,)


def test_train_options_are_config_fields_with_their_defaults(tmp_path):
    """`trt-spec train` builds RunConfig and the configs inside it from its options by the
    fields' public names (two are derived: --max-disk-gb, --temperatures), each option
    showing the default of the first config that has it."""
    import dataclasses

    from trt_spec.cli import main
    from trt_spec.runtime.options import option_names
    from trt_spec.train.configs import (DistillConfig, FeatureConfig, RegenConfig, RunConfig,
                                        ScanConfig, TrainConfig)

    known = {}
    for c in (RunConfig, TrainConfig, FeatureConfig, RegenConfig, DistillConfig, ScanConfig):
        for public, name in option_names(c).items():
            known.setdefault(public, next(f for f in dataclasses.fields(c)
                                          if f.name == name).default)
    command = main.commands["train"]
    params = command.make_context("train", ["--method", "eagle3", "--out", str(tmp_path)]).params
    own = {"max_steps", "resume"}
    derived = {"max_disk_gb": FeatureConfig.max_disk_bytes / 1e9,
               "temperatures": (DistillConfig.t_min, DistillConfig.t_max)}
    assert not set(params) - set(known) - own - set(derived)
    unset = {"lr_scan": (), "warmup_scan": ()}  # None: no scan
    wrong = [(o, v, derived.get(o, known.get(o))) for o, v in params.items()
             if o not in own and known.get(o) is not dataclasses.MISSING
             and (unset.get(o, v) if v is None else v) != derived.get(o, known.get(o))]
    assert not wrong, wrong
    config = RunConfig.from_options(params)
    assert config.train == TrainConfig() and config.features == FeatureConfig()
    assert config.regen == RegenConfig() and config.distill == DistillConfig()
    assert config.scan is None and config.features_mode == "disk"


def test_num_draft_tokens_is_parsed_once_at_the_edge(tiny_engine, monkeypatch):
    """`generate --num-draft-tokens auto:3`: the option's text is parsed once, by the CLI, into
    a DraftTokens that every later step takes as it is (never the text again)."""
    import json

    import trt_spec.runtime.generator as generator_module
    import trt_spec.runtime.settings as settings
    from trt_spec.runtime.settings import DraftTokens

    parse, seen = settings.parse_num_draft_tokens, []

    def spy(value):
        seen.append(value)
        return parse(value)

    monkeypatch.setattr(settings, "parse_num_draft_tokens", spy)
    monkeypatch.setattr(generator_module, "parse_num_draft_tokens", spy)
    result = CliRunner().invoke(main, ["generate", "--engine", str(tiny_engine), "--max-tokens",
                                       "6", "--method", "ngram", "--num-draft-tokens", "auto:3",
                                       "--json", "hello"])
    assert result.exit_code == 0, result.output
    texts = [v for v in seen if not isinstance(v, DraftTokens)]
    assert texts == ["auto:3"], seen
    assert DraftTokens(3, True) in seen  # what travelled on
    assert json.loads(result.output)["metrics"]["adaptive"] is True
