"""`trt-spec doctor`: what this machine can run, and whether an engine folder fits it
(tools/doctor.py)."""

from __future__ import annotations

import json
import sys

import click

from trt_spec.cli.options import fail


@click.command()
@click.option("--engine", "engine", default=None, type=click.Path(file_okay=False),
              help="Also check this engine folder (or bundle) against the machine.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def doctor(engine, as_json):
    """What this machine can run: backends, CPU features, GPU, TensorRT, threads; and whether
    an engine folder fits it. Exit status 1 when the engine folder does not run here."""
    from trt_spec.tools.doctor import report as make_report
    from trt_spec.tools.doctor import report_text, runs_here

    try:
        report = make_report(engine)
    except ValueError as e:
        fail(e)
    click.echo(json.dumps(report) if as_json else report_text(report))
    if not as_json and not runs_here(report):
        sys.exit(1)
