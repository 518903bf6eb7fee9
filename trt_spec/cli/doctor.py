"""`trt-spec doctor`: what this machine can run, and whether an engine folder fits it
(tools/doctor.py)."""

from __future__ import annotations

import json
import sys

import click

from trt_spec.cli.options import (RUNTIME, backend_options, fail, memory_option,
                                  runtime_config)
from trt_spec.runtime.settings import SERVE_MAX_BATCH


@click.command()
@click.option("--engine", "engine", default=None, type=click.Path(file_okay=False),
              help="Also check this engine folder (or bundle) against the machine.")
@click.option("--max-num-seqs", type=click.IntRange(1, 256), default=SERVE_MAX_BATCH,
              show_default=True, help="--engine: count its KV caches at this many slots "
                                      "(serve's option).")
@click.option("--max-model-len", type=click.IntRange(min=2), default=RUNTIME.max_len,
              show_default=True, help="--engine: ... and this context per slot, capped by the "
                                      "model's (serve's option).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
@backend_options
@memory_option
def doctor(engine, as_json, **options):
    """What this machine can run: backends, CPU features, GPU, TensorRT, threads; and whether
    an engine folder fits it: its backend, and its weights and KV caches in memory, as `serve`
    would run it. Exit status 1 when the engine folder does not run here."""
    from trt_spec.tools.doctor import report as make_report
    from trt_spec.tools.doctor import report_text, runs_here

    try:
        report = make_report(engine, runtime_config(options))
    except ValueError as e:
        fail(e)
    click.echo(json.dumps(report) if as_json else report_text(report))
    if not as_json and not runs_here(report):
        sys.exit(1)
