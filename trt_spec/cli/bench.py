"""`trt-spec bench`: tokens/s, tau and acceptance per method and k (tools/bench.py)."""

from __future__ import annotations

import click

from trt_spec.cli.options import (DEFAULT_ENGINE, SPECULATION, backend_options, checked,
                                  comma_list, fail, methods_help, threads_option)
from trt_spec.runtime.options import defaults, from_options
from trt_spec.tools.bench_config import BenchConfig

BENCH = defaults(BenchConfig)


def parse_methods(text: str) -> list[str]:
    from trt_spec.runtime.methods import method as check_method

    methods = comma_list(text)
    for m in methods:
        check_method(m)
    return methods


def parse_ks(text: str) -> list[int | str]:
    """Comma-separated ks: integers, or auto / auto:K (adaptive, at most K)."""
    from trt_spec.runtime.settings import draft_tokens_label, parse_num_draft_tokens

    ks = []
    for item in comma_list(text):
        k, adaptive = parse_num_draft_tokens(item)
        ks.append(draft_tokens_label(k, True) if adaptive else k)
    return ks


def parse_past(text: str) -> list[int]:
    from trt_spec.tools.bench import parse_past as parse

    return parse(text)


def parse_peers(text: str) -> list[str]:
    from trt_spec.tools.peers import parse_peers as parse

    return parse(text)


@click.command()
@click.option("--engine", "engines", multiple=True, type=click.Path(file_okay=False),
              default=(DEFAULT_ENGINE,),
              help="Engine folder; repeat to compare (runs are interleaved) "
                   f"[default: {DEFAULT_ENGINE}].")
@click.option("--prompts", "prompts_file", type=click.Path(dir_okay=False), default=None,
              help='JSONL prompts: {"prompt": ...} or {"messages": [...]} per line, and '
                   'optionally "json_schema": {...}, the structure its answer is held to '
                   "[default: the shipped runtime/data/prompts.jsonl]. The shipped "
                   "runtime/data/sharegpt-heldout.jsonl holds 40 prompts no drafter trained on.")
@click.option("--num-prompts", type=click.IntRange(min=1), default=None,
              help="Only the first N prompts of the file.")
@click.option("--methods", default="none", show_default=True, callback=checked(parse_methods),
              help=methods_help("Comma-separated methods; at temperature 0 'none' always runs "
                                "(the baseline for identical_to_baseline). Methods:"))
@click.option("--num-draft-tokens", "ks", default=str(SPECULATION.num_draft_tokens),
              show_default=True,
              callback=checked(parse_ks),
              help="k, or comma-separated ks to sweep (e.g. 2,4,6); auto or auto:K drafts "
                   "while a token pays for itself, at most K (default 6).")
@click.option("--max-new-tokens", type=click.IntRange(min=2), default=BENCH["max_new_tokens"],
              show_default=True,
              help="New tokens per run (EOS ignored unless --stop-at-eos); under a prompt's "
                   "json_schema, at most this many: the answer ends with its JSON.")
@click.option("--stop-at-eos", is_flag=True,
              help="End each answer at the model's end of turn, as a chat client does (τ then "
                   "measures the answers only; runs differ in length).")
@click.option("--temperature", type=click.FloatRange(min=0), default=BENCH["temperature"],
              show_default=True,
              help="0 = greedy.")
@click.option("--top-p", type=click.FloatRange(1e-20, 1), default=BENCH["top_p"],
              show_default=True,
              help="Sampling: keep the most likely tokens up to this mass (1 = off).")
@click.option("--seed", type=click.IntRange(min=0), default=None,
              help="Sampling: the requests' seed, for repeatable runs; every method then emits "
                   "plain decoding's tokens, which `same` measures [default: a fresh seed per "
                   "request].")
@click.option("--past", "pasts", default="", callback=checked(parse_past),
              help="Also time decoding after synthetic prompts of these lengths "
                   "(comma-separated, e.g. 0,512,1024).")
@click.option("--repeats", type=click.IntRange(min=1), default=BENCH["repeats"],
              show_default=True,
              help="Passes over all prompts (interleaved).")
@click.option("--batch", type=click.IntRange(1, 64), default=BENCH["batch"], show_default=True,
              help="Streams decoding together (groups of prompts; see throughput).")
@click.option("--json", "json_out", type=click.Path(dir_okay=False), default=None,
              help="Write the report (settings, machine, results) to this JSON file.")
@click.option("--peers", default="", callback=checked(parse_peers),
              help="Also time other runtimes on the same model and prompt ids, interleaved with "
                   "ours (batch 1): comma-separated transformers, transformers-assisted, "
                   "onnxruntime-genai, onnxruntime-genai-ngram (its own n-gram speculation), "
                   "onnxruntime-genai-draft (its draft-model speculation with our vanilla "
                   "draft), llama.cpp, llama.cpp-draft (its draft model: our vanilla draft as a "
                   "GGUF), llama.cpp-ngram (its n-gram lookup), openvino (OpenVINO GenAI on "
                   "the GGUF), openvino-lookup (its prompt lookup). The speculating peers run "
                   "once per integer --num-draft-tokens. Prompts with a json_schema: each peer "
                   "holds its answer to the schema with its own structured output. One that "
                   "cannot run is listed as skipped.")
@click.option("--plot", "plot_out", type=click.Path(dir_okay=False), default=None,
              help="Write a bar chart (tokens/s per method and peer, and tau) to this PNG "
                   "(needs matplotlib: pip install -e '.[bench]').")
@click.option("--step-costs", is_flag=True,
              help="Instead: time one target forward of T = 1..9 new tokens after each --past "
                   "(default 64), median of 12 interleaved repeats: the curve c(T)/c(1) that "
                   "bounds what speculation can gain.")
@click.option("--overhead", is_flag=True,
              help="Instead: split one target forward after each --past (default 64) into the "
                   "graph alone, input/output binding, step inputs, sampling, drafting and the "
                   "decode loop, for plain exact, plain fast and the first method of --methods "
                   "other than none (default ngram) at the first k, drafting every step; with "
                   "--peers onnxruntime-genai, its graph alone and the rest of its loop.")
@click.option("--exact-decode/--fast-decode", "exact_decode", default=BENCH["exact_decode"],
              help="--fast-decode: plain 1-token target steps on ONNX Runtime's one-row "
                   "kernels: faster by about c(2)/c(1), but speculative greedy output may then "
                   "differ from plain greedy at near-ties (default: exact; see "
                   "docs/speculative-decoding.md).")
@click.option("--forced-tokens", type=click.IntRange(min=0), default=BENCH["forced_tokens"],
              show_default=True,
              help="Prompts whose lines carry a json_schema: the most grammar-forced tokens "
                   "drafted per step, for free (0: none, to measure what they add).")
@click.option("--spec-fallback/--no-spec-fallback", default=BENCH["fallback"],
              show_default=True,
              help="The policy's gain rules: a step drafts fewer tokens than k, or none, where "
                   "that is measured to be faster; off, every step drafts its k (tau of the "
                   "drafter itself).")
@click.option("--corpus/--no-corpus", default=BENCH["corpus"], show_default=True,
              help="suffix, hybrid, auto: also draft from the engine folder's corpus table of "
                   "answers' phrases, where it has one (trt-spec corpus).")
@threads_option
@backend_options
def bench(step_costs, overhead, json_out, plot_out, **options):
    """Tokens/s, tau and acceptance per method and k, side by side in one process."""
    from trt_spec.tools.bench import bench_report, step_costs_report

    progress = lambda msg: click.echo(msg, err=True)  # noqa: E731
    try:  # the other options are BenchConfig's fields, by name
        config = from_options(BenchConfig, options)
        if step_costs and overhead:
            raise ValueError("--step-costs and --overhead are two different reports; give one")
        if overhead:
            from trt_spec.tools.overhead import overhead_report

            spec = [m for m in config.methods if m != "none"]
            text = overhead_report(config.engines[0], config.pasts, config.threads,
                                   spec[0] if spec else "ngram", config.ks[0],
                                   config.max_new_tokens, json_out, progress, config.peers)
        elif step_costs:
            text = step_costs_report(config.engines[0], config.pasts, config.threads,
                                     config.exact_decode, json_out)
        else:
            text = bench_report(config, progress, json_out, plot_out)
    except ValueError as e:
        fail(e)
    click.echo(text)
