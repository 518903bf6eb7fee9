"""`trt-spec train`: conversations -> (the target's own answers) -> features -> trained
drafters, every stage resumable. Layout of the output folder:

    OUT/answers.jsonl       train/regen.py: the target's answers to the training prompts
                            (--answers target; --answers data trains on the file's answers)
    OUT/answers-heldout.jsonl  the same for the held-out prompts
    OUT/answers/            --answers distill (train/distill_data.py): every human turn
                            answered, greedy and --samples sampled variants, in shards of
                            token ids (--answers-dir puts them elsewhere, e.g. in the
                            repository); OUT/answers/heldout/ the held-out ones, greedy
    OUT/features/           train/features.py (the training split; --features disk)
    OUT/features-heldout/   the same for the held-out split
    OUT/<method>-state.pt   the training state, every --checkpoint-every steps
    OUT/<method>-curve.jsonl  the learning curve, every --eval-every tokens (train/curve.py)
    OUT/scan/, OUT/scan.json  the --lr-scan / --warmup-scan runs and their table (train/scan.py)
    OUT/<method>/           the drafter in trt-spec's own format (`trt-spec export --<method>
                            OUT/<method>`; `--draft-model OUT/draft` for the vanilla draft)
    OUT/metrics.json        per method: training and held-out metrics, tokens seen, seconds

With --features live (the default on cuda) nothing is cached: the target runs on each batch.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Callable

from trt_spec.export.sharegpt import (HELDOUT_FRACTION, fetch_sharegpt, load_tokenizer,
                                      read_conversations, split)
# the configs are train/configs.py's; their names are the pipeline's too
from trt_spec.train.configs import (ANSWERS, FEATURES, METHODS, DistillConfig,  # noqa: F401
                                    FeatureConfig, RegenConfig, RunConfig, ScanConfig,
                                    TrainConfig)
from trt_spec.train.data import tokenize_all
from trt_spec.train.features import FeatureStore, extract
from trt_spec.train.recipes import RECIPES, check_settings
from trt_spec.train.scan import scan_method, scan_table, with_best, write_scan


def check_device(device: str) -> None:
    import torch

    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: torch sees no CUDA device (this torch is "
                         f"{torch.__version__}); use --device cpu")


def write_json(path: Path, data: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1) + "\n")
    os.replace(tmp, path)


def run(config: RunConfig, resume: bool = False, on_stage: Callable[[str, dict], None] | None = None,
        on_progress=None, on_step=None, max_steps: int | None = None, on_scan=None) -> dict:
    """The whole recipe for each method of config.methods. on_stage(name, info) is called as
    each stage ends; on_progress(stage, progress) / on_step are the long stages' callbacks;
    on_scan(method, result) as a method's scan ends (config.scan). Returns {method: metrics};
    also written to OUT/metrics.json (a scan-only method: {"scan": result}, not written)."""
    from trt_spec.export.checkpoint import load_target, resolve_model
    from trt_spec.train.regen import regenerate

    check_device(config.device)
    if config.device == "cuda":
        import torch

        torch.backends.cuda.matmul.allow_tf32 = True  # training and answers, not references
        torch.backends.cudnn.allow_tf32 = True
    out = Path(config.out)
    for method in config.methods:
        state = out / f"{method}-state.pt"
        if state.exists() and not resume:
            raise ValueError(f"{state} exists: pass --resume to continue that run, or choose "
                             "another --out")
    hf_dir = resolve_model(config.model)
    target, _ = load_target(hf_dir)
    check_settings(config, target.config)
    tokenizer = load_tokenizer(hf_dir)
    engine = None
    if config.engine is not None:
        from trt_spec.train.engine_target import EngineTarget

        engine = EngineTarget(config.engine)
        engine.check_model(target.config)
    data = Path(config.data) if config.data else fetch_sharegpt()
    if not data.is_file():
        raise FileNotFoundError(f"--data {str(data)!r} is not a file")
    conversations, report = read_conversations(data)
    train_convs, heldout_convs = split(conversations, HELDOUT_FRACTION)
    if config.answers == "target":
        t0 = time.perf_counter()
        n = config.max_conversations
        stop_ids = list(target.config.eos_token_ids) + (
            [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else [])
        train_convs = regenerate(hf_dir, tokenizer, train_convs[:n] if n else train_convs,
                                 out / "answers.jsonl", stop_ids, config.regen, config.device,
                                 on_progress and (lambda p: on_progress("answers", p)))
        heldout_convs = regenerate(hf_dir, tokenizer, heldout_convs[:max(1, n // 50) if n else None],
                                   out / "answers-heldout.jsonl", stop_ids, config.regen,
                                   config.device)
        if on_stage:
            on_stage("answers", {"conversations": len(train_convs),
                                 "heldout": len(heldout_convs),
                                 "seconds": time.perf_counter() - t0})
    if config.answers == "distill":
        train_convs, heldout_convs = distill_stage(config, target, tokenizer, train_convs,
                                                   heldout_convs, str(hf_dir), data,
                                                   on_stage, on_progress, engine)
        if config.data_only:
            return {}
    train_ex = tokenize_all(tokenizer, train_convs, config.max_len, config.max_tokens)
    heldout_ex = (tokenize_all(tokenizer, heldout_convs, config.max_len, config.heldout_tokens)
                  if config.heldout_tokens else [])
    if not train_ex:
        raise ValueError(f"{data}: no conversation with an assistant turn to train on")
    if on_stage:
        on_stage("data", {"file": str(data), "records": report.records, "kept": report.kept,
                          "skipped": report.skipped, "truncated_file": report.truncated_file,
                          "answers": config.answers,
                          "train_sequences": len(train_ex),
                          "train_tokens": sum(len(e.input_ids) for e in train_ex),
                          "heldout_sequences": len(heldout_ex)})
    model_id = str(hf_dir)
    if config.features_mode == "live":
        from trt_spec.train.live import LiveFeatures

        store = LiveFeatures(target, train_ex, config.features.top_k, config.device, model_id)
        heldout = (LiveFeatures(target, heldout_ex, config.features.top_k, config.device,
                                model_id) if heldout_ex else None)
    elif config.features_mode == "engine":
        from trt_spec.train.engine_target import EngineFeatures

        layers = tuple(target.config.eagle3_layers)
        store = EngineFeatures(engine, train_ex, config.features.top_k, layers)
        heldout = (EngineFeatures(engine, heldout_ex, config.features.top_k, layers)
                   if heldout_ex else None)
    else:
        result = extract(target, train_ex, out / "features", config.features, model_id,
                         on_progress and (lambda p: on_progress("features", p)))
        if on_stage:
            on_stage("features", {"tokens": result.tokens, "shards": result.shards,
                                  "skipped_shards": result.skipped_shards,
                                  "tokens_per_s": result.tokens_per_s,
                                  "bytes_on_disk": result.bytes_on_disk})
        if heldout_ex:
            extract(target, heldout_ex, out / "features-heldout", config.features, model_id)
        store = FeatureStore(out / "features")
        heldout = FeatureStore(out / "features-heldout") if heldout_ex else None
    if heldout is None and (config.train.eval_every or config.scan):
        raise ValueError("no held-out conversation made it into the held-out set: the "
                         "learning curve and a scan need one (raise --heldout-tokens)")
    metrics_path = out / "metrics.json"
    everything = json.loads(metrics_path.read_text()) if metrics_path.exists() else {}
    scanned = {}
    for method in config.methods:
        method_config = config
        if config.scan is not None:
            stage = f"scan {method}"
            result = scan_method(config, method, store, heldout, target, on_stage and (
                lambda r: on_stage(stage, {"lr": f"{r['lr']:g}", "warmup": r["warmup"],
                                           "steps": r["steps"], "acc_0": f"{r['acc'][0]:.3f}",
                                           "done_before": r["skipped"]})))
            write_scan(out, method, result)
            if on_scan:
                on_scan(method, result)
            if config.scan.only:
                scanned[method] = {"scan": result}
                continue
            method_config = with_best(config, result)
        t0 = time.perf_counter()
        metrics = train_method(method_config, method, store, target, resume, on_step, max_steps,
                               heldout)
        metrics["seconds"] = time.perf_counter() - t0
        metrics["train_tokens"] = store.tokens
        metrics["answers"] = config.answers
        metrics["lr"] = method_config.train.lr
        metrics["warmup_steps"] = method_config.train.warmup_steps
        if heldout is not None:
            metrics.update({f"heldout_{k}": v for k, v in evaluate_method(
                method_config, method, heldout, target, out / method).items()})
        everything[method] = metrics
        write_json(metrics_path, everything)
        if on_stage:
            on_stage(f"trained {method}", {k: v for k, v in metrics.items()
                                           if k.startswith(("heldout_acc", "seconds", "step"))})
    return {**everything, **scanned}


def distill_stage(config: RunConfig, target, tokenizer, train_convs, heldout_convs,
                  model_id: str, data: Path, on_stage, on_progress, engine=None):
    """--answers distill: the shards of the training conversations (the first
    --max-conversations) and of the held-out ones (greedy only), then both as the target's
    conversations. With answers_minutes, generation stops after the shard that passes it
    and training reads the shards done so far."""
    from dataclasses import replace

    from trt_spec.train import distill_data

    folder = Path(config.answers_dir) if config.answers_dir else Path(config.out) / "answers"
    if folder.exists() and not folder.is_dir():
        raise ValueError(f"--answers-dir {str(folder)!r} is a file: name a folder for the "
                         "answers' shards")
    stop_ids = list(target.config.eos_token_ids) + (
        [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else [])
    n = config.max_conversations
    todo = train_convs[:n] if n else train_convs
    t0 = time.perf_counter()
    seconds = config.answers_minutes * 60 if config.answers_minutes is not None else None
    held = heldout_convs[:config.heldout_conversations]
    model_id = distill_data.model_identity(Path(model_id), data)
    distill_data.distill(target, tokenizer, held, folder / "heldout", stop_ids,
                         replace(config.distill, samples=0), config.device, model_id,
                         progress=on_progress and (lambda p: on_progress("distill held-out", p)),
                         engine=engine)
    done = distill_data.distill(
        target, tokenizer, todo, folder, stop_ids, config.distill, config.device, model_id,
        seconds, on_progress and (lambda p: on_progress("distill", p)), engine)
    train_out = distill_data.conversations(folder, todo, tokenizer)
    heldout_out = distill_data.conversations(folder / "heldout", held, tokenizer)
    if on_stage:
        shards = -(-len(todo) // config.distill.shard_conversations)
        on_stage("answers", {"folder": str(folder), "shards": f"{done}/{shards}",
                             "trajectories": len(train_out), "heldout": len(heldout_out),
                             "answer_tokens": distill_data.token_count(folder),
                             "seconds": time.perf_counter() - t0})
    if not train_out:
        raise ValueError(f"{folder}: no answers yet to train on")
    return train_out, heldout_out


def train_method(config: RunConfig, method: str, store, target, resume, on_step,
                 max_steps, heldout=None) -> dict:
    """One method's training on `store` (train/recipes.py); with config.train.eval_every, its
    learning curve on `heldout` (OUT/<method>-curve.jsonl)."""
    from trt_spec.train.loop import RunControl

    run = RunControl(config.device, resume, on_step, max_steps,
                     config.max_minutes * 60 if config.max_minutes else None)
    init = init_folder(config, method)
    return RECIPES[method].train(config, method, store, target, run, heldout, init)


def init_folder(config: RunConfig, method: str) -> Path | None:
    """--init-from FOLDER: the drafter FOLDER/<method>/ to fine-tune (None without it)."""
    if config.init_from is None:
        return None
    folder = Path(config.init_from) / method
    if not (folder / "drafter.json").is_file():
        raise FileNotFoundError(f"--init-from {str(config.init_from)!r}: no {method} drafter "
                                f"there ({folder}/drafter.json is missing)")
    return folder


def evaluate_method(config: RunConfig, method: str, store, target, head_dir) -> dict:
    """The drafter saved in head_dir, evaluated on `store` (train/recipes.py)."""
    return RECIPES[method].evaluate(config, method, store, target, head_dir)


def parse_methods(text: str) -> tuple[str, ...]:
    """`--method`: 'eagle3,mtp' or 'all' -> the methods, each one of METHODS."""
    names = list(METHODS) if text.strip() == "all" else [
        m.strip() for m in text.split(",") if m.strip()]
    unknown = [m for m in names if m not in METHODS]
    if not names or unknown:
        raise ValueError(f"{text!r}: expected a comma-separated list of {', '.join(METHODS)}, "
                         "or all")
    return tuple(names)


def parse_layers(text: str) -> tuple[int, ...]:
    """`--draft-layers`: '0,1' -> (0, 1)."""
    try:
        layers = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise ValueError(f"{text!r}: expected comma-separated layer numbers, e.g. 0,1") from None
    if not layers:
        raise ValueError(f"{text!r}: name at least one layer")
    return layers


def stage_line(name: str, info: dict) -> str:
    return f"{name}: " + ", ".join(f"{k} {v:.1f}" if isinstance(v, float) else f"{k} {v}"
                                   for k, v in info.items())


def progress_line(stage: str, p) -> str:
    if stage.startswith("distill"):
        eta = "" if p.eta_s != p.eta_s else f", ETA {p.eta_s / 60:.1f} min"  # nan: mid-shard
        what = "held-out answers" if stage.endswith("held-out") else "answers"
        return (f"{what}: {p.shards_done}/{p.shards} shards written, {p.new_tokens} tokens, "
                f"{p.tokens_per_s:.0f} tokens/s{eta}")
    if stage == "answers":
        return (f"answers: {p.done}/{p.total} prompts, {p.new_tokens} tokens, "
                f"{p.tokens_per_s:.0f} tokens/s, ETA {p.eta_s / 60:.1f} min")
    return (f"features: shard {p.shard}/{p.shards}, {p.tokens_done}/{p.tokens_todo} tokens, "
            f"{p.tokens_per_s:.0f} tokens/s, ETA {p.eta_s / 60:.1f} min")


def step_line(s) -> str | None:
    """A training step's line: the 1st, every 10th, the last and those with a learning-curve
    record; None for the others."""
    if not (s.step == 1 or s.step % 10 == 0 or s.step == s.total or s.heldout):
        return None
    accs = " ".join(f"{v:.2f}" for k, v in sorted(s.metrics.items()) if k.startswith("acc_"))
    line = (f"train: step {s.step}/{s.total}, loss {s.metrics['loss']:.3f}, acc by step {accs}, "
            f"lr {s.lr:.2e}, {s.tokens_per_s:.0f} tokens/s")
    if s.heldout:
        h = s.heldout
        line += (f"; held-out at {h['tokens_seen']} tokens: acc by step "
                 + " ".join(f"{a:.2f}" for a in h["acc"]) + f", tau_est {h['tau_est']:.2f}")
    return line


def train_drafters(config: RunConfig, resume: bool = False, max_steps: int | None = None,
                   log=print) -> dict:
    """`trt-spec train`: `config` (the command builds it from its options) run with every
    stage's progress as lines to `log`. Returns {method: {"drafter": OUT/method, **metrics}}
    for the methods asked for ({method: {"scan": result}} with a scan only)."""
    methods, out = config.methods, config.out

    def on_step(s):
        line = step_line(s)
        if line is not None:
            log(line)

    metrics = run(config, resume, lambda name, info: log(stage_line(name, info)),
                  lambda stage, p: log(progress_line(stage, p)), on_step, max_steps,
                  lambda method, result: log(scan_table(method, result)))
    return {m: v if "scan" in v else {"drafter": str(Path(out) / m), **v}
            for m, v in metrics.items() if m in methods}
