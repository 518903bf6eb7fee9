"""`trt-spec generate`: one prompt, one answer (tools/generate.py)."""

from __future__ import annotations

import json

import click

from trt_spec.cli.options import (backend_options, engine_option, fail, methods_help,
                                  sampling_options,
                                  speculation_options, threads_option)


@click.command()
@engine_option
@click.option("--method", default="none", show_default=True,
              help=methods_help("What drafts (a model drafter needs its graphs in the engine "
                                "folder):"))
@speculation_options
@sampling_options
@click.option("--chat/--no-chat", default=None,
              help="Apply the chat template to PROMPT [default: when the model has one].")
@click.option("--json", "as_json", is_flag=True,
              help="Print one JSON object: text, token_ids, finish_reason, metrics.")
@threads_option
@backend_options
@click.argument("prompt")
def generate(engine, method, num_draft_tokens, ngram_min, ngram_max, spec_max_batch,
             spec_min_acceptance, spec_fallback, max_tokens, temperature, top_k, top_p, seed, stop, chat, as_json,
             threads, backend, device, prompt):
    """Generate an answer to PROMPT."""
    from trt_spec.runtime.sampling import SamplingParams
    from trt_spec.runtime.settings import RuntimeConfig
    from trt_spec.tools.generate import generate_one, summary_line

    try:
        config = RuntimeConfig.from_options(
            method=method, num_draft_tokens=num_draft_tokens, ngram_min=ngram_min,
            ngram_max=ngram_max, spec_max_batch=spec_max_batch,
            min_acceptance=spec_min_acceptance, fallback=spec_fallback, threads=threads,
            backend=backend, device=device)
        params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_k=top_k,
                                top_p=top_p, seed=seed, stop=stop)
        answer = generate_one(engine, prompt, config, params, chat)
    except ValueError as e:
        fail(e)
    if as_json:
        click.echo(json.dumps(answer.as_dict()))
        return
    click.echo(answer.text)
    click.echo(summary_line(answer), err=True)
