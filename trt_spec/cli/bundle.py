"""`trt-spec bundle` and `trt-spec verify`: a deployable folder cut from an engine folder, and
its check (tools/bundle.py)."""

from __future__ import annotations

import sys

import click

from trt_spec.cli.options import comma_list, fail, threads_option


@click.command()
@click.argument("engine_dir", type=click.Path(file_okay=False))
@click.argument("out", type=click.Path(file_okay=False))
@click.option("--methods", default=None,
              help="Comma-separated methods to keep (none is always kept), e.g. eagle3 "
                   "[default: every method the folder has].")
@click.option("--tar", is_flag=True, help="Also write OUT.tar.gz.")
def bundle(engine_dir, out, methods, tar):
    """Cut ENGINE_DIR down to a deployable folder OUT: the chosen methods' graphs, tokenizer,
    pinned requirements.txt, checksums and an expected greedy output for `verify`."""
    from trt_spec.tools.bundle import bundle as make_bundle
    from trt_spec.tools.bundle import describe

    chosen = comma_list(methods) if methods else None
    try:
        path = make_bundle(engine_dir, out, chosen, tar,
                           progress=lambda msg: click.echo(msg, err=True))
    except (ValueError, FileExistsError) as e:
        fail(e)
    click.echo(describe(path))


@click.command()
@click.argument("folder", type=click.Path(file_okay=False))
@threads_option
def verify(folder, threads):
    """Check a bundle: files and checksums, pinned requirements against this environment,
    and its stored greedy output reproduced. Exit status 1 when it does not hold."""
    from trt_spec.tools.bundle import verify as check
    from trt_spec.tools.bundle import verify_lines

    try:
        report = check(folder, threads)
    except ValueError as e:
        fail(e)
    click.echo("\n".join(verify_lines(report)))
    if not report["ok"]:
        sys.exit(1)
