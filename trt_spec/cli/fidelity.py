"""`trt-spec fidelity`: how closely one engine follows a reference (tools/fidelity.py)."""

from __future__ import annotations

import json

import click

from trt_spec.cli.options import engine_option, fail, threads_option


@click.command()
@click.option("--reference", required=True, type=click.Path(file_okay=False),
              help="Reference engine folder (e.g. the fp32 export).")
@engine_option
@click.option("--prompts", "prompts_file", type=click.Path(dir_okay=False), default=None,
              help="JSONL prompts [default: the shipped runtime/data/prompts.jsonl].")
@click.option("--num-prompts", type=click.IntRange(min=1), default=None,
              help="Only the first N prompts of the file.")
@click.option("--max-new-tokens", type=click.IntRange(min=2), default=64, show_default=True,
              help="Length of the reference's greedy continuation per prompt.")
@click.option("--llama-cpp", "llama_cpp", is_flag=True,
              help="Also measure llama.cpp (llama-server on the GGUF the reference was exported "
                   "from) on the same positions; its KL is over its top 100 tokens "
                   "(mean_kl_top, given for ENGINE too).")
@click.option("--onnxruntime-genai", "ortgenai", is_flag=True,
              help="Also measure onnxruntime-genai's int4 model (its builder on the model the "
                   "reference was exported from; needs pip install -e '.[bench]') on the same "
                   "positions.")
@threads_option
def fidelity(reference, engine, prompts_file, num_prompts, max_new_tokens, llama_cpp, ortgenai,
             threads):
    """How closely ENGINE follows REFERENCE, by teacher forcing: greedy agreement, mean KL."""
    from trt_spec.tools.fidelity import compare

    try:
        report = compare(reference, engine, prompts_file, num_prompts, max_new_tokens,
                         llama_cpp, threads, ortgenai)
    except ValueError as e:
        fail(e)
    click.echo(json.dumps(report))
