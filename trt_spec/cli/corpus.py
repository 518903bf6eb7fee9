"""`trt-spec corpus`: an engine folder's n-gram table of answers (export/corpus.py)."""

from __future__ import annotations

import click

from trt_spec.cli.options import DEFAULT_ENGINE, fail


@click.command()
@click.option("--engine", "engine", default=DEFAULT_ENGINE, show_default=True,
              type=click.Path(file_okay=False), help="The engine folder to add the table to.")
@click.option("--conversations", type=click.IntRange(min=0), default=3000, show_default=True,
              help="ShareGPT conversations whose answers are indexed (the training split: "
                   "held-out conversations never); 0: none.")
@click.option("--distilled", type=click.Path(exists=True, file_okay=False), default=None,
              help="Also index a self-distilled data folder's answers (train/data/<model>: "
                   "the target's own answers to training prompts).")
@click.option("--max-n", type=click.IntRange(1, 16), default=8, show_default=True,
              help="The longest n-gram indexed.")
@click.option("--min-count", type=click.IntRange(min=1), default=3, show_default=True,
              help="An n-gram is kept when it occurs at least this often.")
@click.option("--min-prob", type=click.FloatRange(0, 1), default=0.2, show_default=True,
              help="... and its most frequent continuation has at least this share.")
@click.option("--force", is_flag=True, help="Build it again even if it is up to date.")
@click.option("--remove", is_flag=True, help="Remove the folder's table instead.")
def corpus(engine, conversations, distilled, max_n, min_count, min_prob, force, remove):
    """Add to an engine folder a table of the phrases answers share: what most often follows
    each n-gram of 1..--max-n tokens in ShareGPT's answers (and, with --distilled, the
    target's own). The suffix lookups (methods suffix, hybrid and auto) draft from it where
    the stream's own tokens match nothing longer than one token; --no-corpus on generate,
    bench and serve turns it off."""
    from trt_spec.export.corpus import add_corpus, remove_corpus

    try:
        if remove:
            remove_corpus(engine)
            click.echo(f"removed the corpus table of {engine}")
            return
        add_corpus(engine, conversations, distilled, max_n, min_count, min_prob, force=force,
                   progress=lambda m: click.echo(m, err=True))
    except ValueError as e:
        fail(e)
