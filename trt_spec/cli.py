"""`trt-spec`: export, generate, bench. The same option names on every command."""

from __future__ import annotations

import json
import sys

import click

DEFAULT_ENGINE = "engines/smollm2-135m"


def engine_option(f):
    return click.option("--engine", "engine", default=DEFAULT_ENGINE, show_default=True,
                        type=click.Path(file_okay=False),
                        help="Engine folder written by `trt-spec export`.")(f)


def threads_option(f):
    return click.option("--threads", type=click.IntRange(min=1), default=None,
                        help="CPU threads for ONNX Runtime (default: all cores, or "
                             "$TRT_SPEC_THREADS).")(f)


def fail(e: Exception):
    raise click.ClickException(str(e)) from e


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="trt-spec")
def main():
    """trt-spec: exported speculative decoding on ONNX Runtime (and TensorRT)."""


@main.command()
@click.option("--model", default="smollm2-135m", show_default=True,
              help="A known model name (smollm2-135m), a local .gguf file, or a Hugging Face "
                   "folder (config.json + safetensors + tokenizer) of a Llama-family model.")
@click.option("--precision", type=click.Choice(["fp32", "int8", "int4"]), default="int4",
              show_default=True, help="Weight precision of the exported graphs.")
@click.option("--backend", type=click.Choice(["ort"]), default="ort", show_default=True,
              help="Lowering target (TensorRT arrives with its own issue).")
@click.option("--out", type=click.Path(file_okay=False), default=None,
              help="Output engine folder [default: engines/<model name>].")
@click.option("--force", is_flag=True, help="Export again even if --out is up to date.")
def export(model, precision, backend, out, force):
    """Export a model to an engine folder (graphs, tokenizer, manifest)."""
    from pathlib import Path

    from trt_spec.export.pipeline import export_engine

    if out is None:
        out = f"engines/{Path(model).stem if model.endswith('.gguf') else Path(model).name}"
    try:
        export_engine(model, Path(out), precision, backend, force)
    except (ValueError, FileNotFoundError, KeyError) as e:
        fail(e)
    click.echo(out)


def sampling_options(f):
    for opt in reversed([
        click.option("--max-tokens", type=click.IntRange(min=1), default=128, show_default=True,
                     help="Most new tokens per prompt."),
        click.option("--temperature", type=click.FloatRange(min=0), default=0.0,
                     show_default=True, help="0 = greedy."),
        click.option("--top-k", type=click.IntRange(min=0), default=0, show_default=True,
                     help="Keep the k most likely tokens (0 = off)."),
        click.option("--top-p", type=click.FloatRange(min=0, max=1, min_open=True), default=1.0,
                     show_default=True, help="Nucleus sampling mass (1 = off)."),
        click.option("--seed", type=int, default=None, help="Seed for reproducible sampling."),
        click.option("--stop", multiple=True, help="Stop string (repeatable)."),
    ]):
        f = opt(f)
    return f


@main.command()
@engine_option
@click.option("--method", default="none", show_default=True,
              help="Speculative method; 'none' decodes one token per target forward.")
@sampling_options
@click.option("--chat/--no-chat", default=None,
              help="Apply the chat template to PROMPT [default: when the model has one].")
@click.option("--json", "as_json", is_flag=True,
              help="Print one JSON object: text, token_ids, finish_reason, metrics.")
@threads_option
@click.argument("prompt")
def generate(engine, method, max_tokens, temperature, top_k, top_p, seed, stop, chat, as_json,
             threads, prompt):
    """Generate an answer to PROMPT."""
    from trt_spec.runtime.generator import Generator
    from trt_spec.runtime.sampling import SamplingParams

    try:
        params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_k=top_k,
                                top_p=top_p, seed=seed, stop=stop)
        gen = Generator(engine, method=method, max_len=2048, threads=threads)
        result = gen.generate([prompt], params, chat=chat)[0]
    except ValueError as e:
        fail(e)
    m = result.metrics
    if as_json:
        click.echo(json.dumps({"text": result.text, "token_ids": result.token_ids,
                               "finish_reason": result.finish_reason,
                               "metrics": {**m, "load_s": gen.load_seconds}}))
        return
    click.echo(result.text)
    rate = m["decode_tokens_per_s"]
    click.echo(f"[{m['completion_tokens']} tokens, "
               f"{'n/a' if rate is None else f'{rate:.1f}'} tokens/s decode, "
               f"first token {1000 * m['time_to_first_token_s']:.0f} ms, "
               f"finish: {result.finish_reason}]", err=True)


@main.command()
@click.option("--engine", "engines", multiple=True, type=click.Path(file_okay=False),
              help="Engine folder; repeat to compare (runs are interleaved) "
                   f"[default: {DEFAULT_ENGINE}].")
@click.option("--methods", default="none", show_default=True,
              help="Comma-separated methods to run.")
@click.option("--max-tokens", type=click.IntRange(min=2), default=128, show_default=True,
              help="New tokens per run (EOS ignored).")
@click.option("--prompts", "num_prompts", type=click.IntRange(min=1, max=8), default=8,
              show_default=True, help="How many of the built-in chat prompts to run.")
@click.option("--past", default="", show_default=True,
              help="Comma-separated past lengths (e.g. 0,512,1024): also time decoding after a "
                   "synthetic prompt of that many tokens.")
@click.option("--repeats", type=click.IntRange(min=1), default=2, show_default=True,
              help="Passes over everything (interleaved).")
@click.option("--json", "json_out", type=click.Path(dir_okay=False), default=None,
              help="Also write the results to this JSON file.")
@threads_option
def bench(engines, methods, max_tokens, num_prompts, past, repeats, json_out, threads):
    """Decode speed: batch 1, greedy, median tokens/s over prompts, side by side."""
    from trt_spec.runtime.bench import parse_past, run_bench

    try:
        report = run_bench(list(engines) or [DEFAULT_ENGINE], methods.split(","), max_tokens,
                           num_prompts, parse_past(past), repeats, threads,
                           progress=lambda msg: click.echo(msg, err=True))
    except ValueError as e:
        fail(e)
    click.echo(report["table"])
    if json_out:
        with open(json_out, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    sys.exit(main())
