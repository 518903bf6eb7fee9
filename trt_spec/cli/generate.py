"""`trt-spec generate`: one prompt, one answer (tools/generate.py)."""

from __future__ import annotations

import json

import click

from trt_spec.cli.options import (backend_options, chat_template_option, engine_option,
                                  fail, memory_option, methods_help, runtime_config,
                                  sampling_options, sampling_params, speculation_options,
                                  threads_option)


@click.command()
@engine_option
@click.option("--method", default="none", show_default=True,
              help=methods_help("What drafts (a model drafter needs its graphs in the engine "
                                "folder):"))
@speculation_options
@sampling_options
@click.option("--chat/--no-chat", default=None,
              help="Apply the chat template to PROMPT [default: when the model has one].")
@chat_template_option
@click.option("--json", "as_json", is_flag=True,
              help="Print one JSON object: text, token_ids, finish_reason, metrics.")
@threads_option
@backend_options
@memory_option
@click.argument("prompt")
def generate(engine, chat, as_json, prompt, **options):
    """Generate an answer to PROMPT."""
    from trt_spec.tools.generate import generate_one, summary_line

    try:  # the other options are RuntimeConfig's and SamplingParams' fields, by name
        answer = generate_one(engine, prompt, runtime_config(options), sampling_params(options),
                              chat)
    except ValueError as e:
        fail(e)
    if as_json:
        click.echo(json.dumps(answer.as_dict()))
        return
    click.echo(answer.text)
    click.echo(summary_line(answer), err=True)
