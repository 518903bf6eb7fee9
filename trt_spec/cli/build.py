"""`trt-spec build`: TensorRT engines from an engine folder's graphs (export/trt_build.py)."""

from __future__ import annotations

import json

import click

from trt_spec.cli.options import comma_list, fail


@click.command()
@click.argument("engine_dir", type=click.Path(file_okay=False))
@click.option("--max-batch", type=click.IntRange(min=1), default=8, show_default=True,
              help="Largest batch of both profiles (B).")
@click.option("--max-draft-tokens", type=click.IntRange(min=1), default=4, show_default=True,
              help="k: the decode/verify profile covers new_tokens 1..k+1.")
@click.option("--max-prefill", type=click.IntRange(min=1), default=None,
              help="Longest prompt of the prefill profile [default: max_len].")
@click.option("--max-len", type=click.IntRange(min=2), default=None,
              help="KV-cache rows the engines are built for [default: the model's positions].")
@click.option("--graphs", default=None, help="Comma-separated graph names [default: all].")
@click.option("--plugin-library", "plugin_libraries", multiple=True,
              type=click.Path(dir_okay=False), help="A plugin .so to load (repeatable).")
@click.option("--plugin-module", "plugin_modules", multiple=True,
              help="A Python module with tensorrt.plugin registrations (repeatable).")
@click.option("--workspace-gb", type=click.FloatRange(min=0, min_open=True), default=None,
              help="Builder workspace limit.")
@click.option("--dry-run", is_flag=True,
              help="Print the plan (graphs, profiles, plugins) as JSON; needs no TensorRT.")
def build(engine_dir, max_batch, max_draft_tokens, max_prefill, max_len, graphs,
          plugin_libraries, plugin_modules, workspace_gb, dry_run):
    """Build TensorRT engines from ENGINE_DIR's ONNX graphs (strongly typed, a prefill and a
    decode/verify profile) and record them in its manifest."""
    from trt_spec.export.trt_build import TensorRTMissing, build as build_engines
    from trt_spec.export.trt_build import dry_run as plan

    names = comma_list(graphs) if graphs else None
    try:
        if dry_run:
            click.echo(json.dumps(plan(engine_dir, max_batch, max_draft_tokens, max_prefill,
                                       max_len, names, plugin_libraries, plugin_modules),
                                  indent=1))
            return
        info = build_engines(engine_dir, max_batch, max_draft_tokens, max_prefill, max_len,
                             names, plugin_libraries, plugin_modules, workspace_gb)
    except (ValueError, TensorRTMissing, FileNotFoundError) as e:
        fail(e)
    click.echo(f"built {len(info['engines'])} engines with TensorRT {info['version']} in "
               f"{engine_dir}")
