"""Options shared by several `trt-spec` commands (the same names everywhere), the checks that
turn a bad value into a click usage error, and `fail`: a library error as one click line."""

from __future__ import annotations

import click

DEFAULT_ENGINE = "engines/smollm2-135m"

# generate / bench / serve: the runtime backend that runs an engine folder
from trt_spec.runtime.sampling import SamplingParams
from trt_spec.runtime.settings import (BACKENDS as RUNTIME_BACKENDS, EXECUTORS,
                                       MAX_DRAFT_TOKENS, RuntimeConfig, SpeculationConfig)

RUNTIME = RuntimeConfig()  # the defaults every runtime option shows (runtime/settings.py)
SPECULATION = SpeculationConfig()
SAMPLING = SamplingParams()  # the sampling options' defaults (runtime/sampling.py)


def fail(e: Exception):
    """A library error (ValueError, FileNotFoundError, ...) -> one line, exit status 1."""
    message = e.args[0] if isinstance(e, KeyError) and e.args else str(e)  # no repr quotes
    raise click.ClickException(str(message)) from e


def checked(parse):
    """A click callback from a library parser: parse(value) -> parsed, ValueError -> a usage
    error naming the option (the parser's message quotes the bad value and what is allowed)."""
    def callback(ctx, param, value):
        if value is None:
            return None
        try:
            return parse(value)
        except ValueError as e:
            raise click.BadParameter(str(e), ctx=ctx, param=param) from None
    return callback


def runtime_config(options: dict) -> RuntimeConfig:
    """A command's RuntimeConfig from its options: each option is named after a field of
    RuntimeConfig or SpeculationConfig, or after the public name the field declares
    (runtime/settings.py `option`), so nothing is renamed here."""
    names = RuntimeConfig.option_names()
    return RuntimeConfig.from_options(**{k: v for k, v in options.items() if k in names})


def sampling_params(options: dict) -> SamplingParams:
    """A command's SamplingParams from its sampling options (named after its fields)."""
    import dataclasses

    names = {f.name for f in dataclasses.fields(SamplingParams)}
    return SamplingParams(**{k: v for k, v in options.items() if k in names})


def comma_list(text: str) -> list[str]:
    """'a, b,,c' -> ['a', 'b', 'c']."""
    return [x.strip() for x in text.split(",") if x.strip()]


def engine_option(f):
    return click.option("--engine", "engine", default=DEFAULT_ENGINE, show_default=True,
                        type=click.Path(file_okay=False),
                        help="Engine folder written by `trt-spec export`.")(f)


def chat_template_option(f):
    return click.option("--chat-template", type=click.Path(dir_okay=False), default=None,
                        help="A chat template file (its Jinja text, or a JSON whose "
                             "\"chat_template\" it is, as tokenizer_config.json) used in "
                             "place of the engine folder's [default: the folder's].")(f)


def threads_option(f):
    return click.option("--threads", type=click.IntRange(min=1), default=None,
                        help="CPU threads for ONNX Runtime (default: all cores, or "
                             "$TRT_SPEC_THREADS).")(f)


def sampling_options(f):
    for opt in reversed([
        click.option("--max-tokens", type=click.IntRange(min=1), default=SAMPLING.max_tokens,
                     show_default=True,
                     help="Most new tokens per prompt."),
        click.option("--temperature", type=click.FloatRange(min=0), default=SAMPLING.temperature,
                     show_default=True, help="0 = greedy."),
        click.option("--top-k", type=click.IntRange(min=0), default=SAMPLING.top_k,
                     show_default=True,
                     help="Keep the k most likely tokens (0 = off)."),
        click.option("--top-p", type=click.FloatRange(min=0, max=1, min_open=True),
                     default=SAMPLING.top_p,
                     show_default=True, help="Nucleus sampling mass (1 = off)."),
        click.option("--min-p", "min_p", type=float, default=SAMPLING.min_p, show_default=True,
                     help="Drop tokens less likely than this times the most likely (0 = off)."),
        click.option("--presence-penalty", type=float, default=SAMPLING.presence_penalty,
                     show_default=True,
                     help="-2..2: subtracted from each token already in the output (OpenAI)."),
        click.option("--frequency-penalty", type=float, default=SAMPLING.frequency_penalty,
                     show_default=True,
                     help="-2..2: subtracted per occurrence in the output so far (OpenAI)."),
        click.option("--repetition-penalty", type=float, default=SAMPLING.repetition_penalty,
                     show_default=True,
                     help="> 0: divides (or multiplies, when negative) the logits of tokens in "
                          "the prompt or output (vLLM; 1 = off)."),
        click.option("--logit-bias", "logit_bias", multiple=True, metavar="ID=BIAS",
                     callback=checked(parse_logit_bias),
                     help="Add BIAS (-100..100) to token ID's logit (repeatable)."),
        click.option("--seed", type=int, default=None, help="Seed for reproducible sampling."),
        click.option("--stop", multiple=True, help="Stop string (repeatable)."),
        click.option("--json-schema", "json_schema", metavar="FILE", default=None,
                     callback=checked(read_text),
                     help="Hold the output to this JSON schema (a .json file)."),
        click.option("--regex", default=None,
                     help="Hold the output to this regular expression."),
        click.option("--grammar", metavar="FILE", default=None, callback=checked(read_text),
                     help="Hold the output to this grammar (llguidance's Lark dialect)."),
        click.option("--choice", multiple=True,
                     help="Hold the output to one of these strings (repeatable)."),
    ]):
        f = opt(f)
    return f


def parse_logit_bias(pairs: tuple[str, ...]) -> tuple[tuple[str, float], ...]:
    """('1234=5', '7=-100') -> (('1234', 5.0), ('7', -100.0)): SamplingParams' logit_bias
    pairs (it checks the ids and biases)."""
    out = []
    for pair in pairs:
        token, sep, bias = pair.partition("=")
        try:
            out.append((token.strip(), float(bias)))
        except ValueError:
            sep = ""
        if not sep:
            raise ValueError(f"{pair!r}: expected ID=BIAS, e.g. 1234=-100")
    return tuple(out)


def read_text(path: str) -> str:
    """A file's text, or ValueError quoting the path."""
    from pathlib import Path

    try:
        return Path(path).read_text()
    except OSError as e:
        raise ValueError(f"{path!r}: {e.strerror or e}") from None


class DraftTokensType(click.ParamType):
    """k or auto / auto:K -> settings.DraftTokens: parsed here, once, and passed on parsed."""

    name = "K|auto[:K]"

    def convert(self, value, param, ctx):
        from trt_spec.runtime.settings import DraftTokens, parse_num_draft_tokens

        if isinstance(value, DraftTokens):
            return value
        try:
            return parse_num_draft_tokens(value if isinstance(value, str) else int(value))
        except ValueError as e:
            self.fail(str(e), param, ctx)


def speculation_options(f):
    for opt in reversed([
        click.option("--num-draft-tokens", "num_draft_tokens", type=DraftTokensType(),
                     default=str(SPECULATION.num_draft_tokens), show_default=True,
                     help=f"k: tokens drafted per step (1..{MAX_DRAFT_TOKENS}); auto or auto:K: "
                          "each step drafts while a token pays for itself, at most K "
                          "(default 6)."),
        click.option("--ngram-min", type=click.IntRange(min=1), default=SPECULATION.ngram_min,
                     show_default=True, help="ngram: shortest suffix to match."),
        click.option("--ngram-max", type=click.IntRange(min=1), default=SPECULATION.ngram_max,
                     show_default=True, help="ngram: longest suffix to match."),
        click.option("--corpus/--no-corpus", default=SPECULATION.corpus, show_default=True,
                     help="suffix, hybrid, auto: also draft the phrases answers share, from the "
                          "engine folder's corpus table where it has one (trt-spec corpus)."),
        click.option("--spec-max-batch", type=click.IntRange(min=1), default=None,
                     help="Speculate only while at most this many streams decode."),
        click.option("--spec-min-acceptance", type=click.FloatRange(0, 1),
                     default=SPECULATION.min_acceptance,
                     show_default=True,
                     help="Turn speculation off for a stream whose rolling acceptance rate "
                          "falls below this (0: never)."),
        click.option("--forced-tokens", type=click.IntRange(0, MAX_DRAFT_TOKENS),
                     default=SPECULATION.forced_tokens, show_default=True,
                     help="Structured outputs: the most tokens the grammar forces (allows one "
                          "way only) drafted per step, for free, whatever the method (0: "
                          "none)."),
        click.option("--grammar-drafts/--no-grammar-drafts",
                     default=SPECULATION.grammar_drafts, show_default=True,
                     help="Structured outputs: model drafters (vanilla, mtp, eagle, eagle3) "
                          "draft under the grammar's mask, so every draft token is one the "
                          "structure allows (lossless: a sampled draft's q is renormalised)."),
        click.option("--spec-fallback/--no-spec-fallback", default=SPECULATION.fallback,
                     show_default=True,
                     help="The policy's gain rules, from measured costs and acceptance: a "
                          "step drafts fewer tokens than k where the later ones cost more than "
                          "they add, and a stream whose speculation emits fewer tokens per unit "
                          "of time than plain decoding would takes plain steps for a while."),
    ]):
        f = opt(f)
    return f


def methods_help(intro: str) -> str:
    """`intro`, then every method of the registry (runtime/methods.py) with its one line."""
    from trt_spec.runtime.methods import METHODS

    return intro + " " + "; ".join(f"{m.name}: {m.summary}" for m in METHODS.values()) + "."


def memory_option(f):
    """--memory-utilization: how much of the machine's memory the engine may take (generate,
    serve; runtime/memory.py)."""
    return click.option(
        "--memory-utilization", type=click.FloatRange(min=0, min_open=True),
        default=RUNTIME.memory_utilization, show_default=True,
        help="The share of the available memory (host RAM on ort; the GPU's free memory on "
             "torch-cuda and trt) the weights and KV caches may take; more is refused at "
             "start, naming the settings that fit. Above 1 goes past what is available "
             "(swap).")(f)


def backend_options(f):
    """--backend, --device and --executor: where the engine runs (generate, bench, serve)."""
    for opt in reversed([
        click.option("--backend", type=click.Choice(RUNTIME_BACKENDS), default=RUNTIME.backend,
                     show_default=True,
                     help="The runtime backend: ort (the folder's ONNX graphs on ONNX Runtime), "
                          "torch-cuda (the export modules with torch, weights from the folder's "
                          "source model, and CUDA graphs) or trt (the folder's TensorRT engines, "
                          "built with `trt-spec build`; needs TensorRT)."),
        click.option("--device", default=None,
                     help="torch-cuda / trt: the torch device [default: cuda when available, "
                          "else cpu]."),
        click.option("--executor", type=click.Choice(EXECUTORS), default=RUNTIME.executor,
                     show_default=True,
                     help="What steps each request: device (drafting, verification and "
                          "sampling on the device, CUDA graphs on a GPU; torch-cuda, the CPU "
                          "included) for every request it covers, the others on the host, "
                          "the reason in each request's metrics; host (the host loop, every "
                          "backend); auto: device on torch-cuda over a CUDA device, else "
                          "host."),
    ]):
        f = opt(f)
    return f
