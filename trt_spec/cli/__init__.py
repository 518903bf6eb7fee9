"""`trt-spec`: export, corpus, build, generate, bench, fidelity, bundle, verify, doctor, serve, train.
The same option names on every command (options.py).

One module per command. A command parses and validates its options, calls one function of
the module the work belongs to (export/, runtime/, serve/, tools/, train/) and prints what it
returns; a library error becomes one click error line (options.fail)."""

from __future__ import annotations

import click

from trt_spec.cli.bench import bench
from trt_spec.cli.build import build
from trt_spec.cli.bundle import bundle, verify
from trt_spec.cli.corpus import corpus
from trt_spec.cli.doctor import doctor
from trt_spec.cli.export import export
from trt_spec.cli.fidelity import fidelity
from trt_spec.cli.generate import generate
from trt_spec.cli.options import DEFAULT_ENGINE
from trt_spec.cli.serve import serve
from trt_spec.cli.train import train

__all__ = ["main", "DEFAULT_ENGINE"]


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="trt-spec")
def main():
    """trt-spec: exported speculative decoding on ONNX Runtime (and TensorRT)."""


for command in (export, corpus, generate, bench, serve, fidelity, bundle, build, verify, doctor, train):
    main.add_command(command)
