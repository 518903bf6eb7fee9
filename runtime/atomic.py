"""Folders that appear whole or not at all."""

from __future__ import annotations

import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def atomic_folder(out: Path):
    """Yields an empty temporary folder beside `out`. If the block completes, the folder
    replaces `out` (one rename); if it raises, `out` is left as it was and the folder goes."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=out.name + ".tmp"))
    try:
        yield tmp
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
