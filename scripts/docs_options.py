"""Writes `trt-spec serve`'s options table (trt_spec/cli/config.py options_table: each
option, its environment variable, its default) into docs/serving.md, between the markers
<!-- serve-options --> and <!-- /serve-options -->; tests/test_serve_config.py checks it.

    python scripts/docs_options.py
"""

from pathlib import Path

from trt_spec.cli import main
from trt_spec.cli.config import options_table

DOCS = Path(__file__).resolve().parents[1] / "docs" / "serving.md"
START, END = "<!-- serve-options -->\n", "<!-- /serve-options -->"


def main_() -> None:
    text = DOCS.read_text()
    if START not in text or END not in text:
        raise SystemExit(f"{DOCS}: no {START.strip()} ... {END} markers")
    head, rest = text.split(START, 1)
    _, tail = rest.split(END, 1)
    DOCS.write_text(head + START + options_table(main.commands["serve"]) + END + tail)
    print(f"wrote the options table into {DOCS}")


if __name__ == "__main__":
    main_()
