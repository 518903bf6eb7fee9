"""Where trt-spec keeps what it downloads or derives, and folders that appear whole or not at
all. Torch-free: the runtime (bench's peers) uses it as well as the exporter."""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path


def cache_dir() -> Path:
    """$TRT_SPEC_CACHE, else $XDG_CACHE_HOME/trt-spec (~/.cache/trt-spec)."""
    root = os.environ.get("TRT_SPEC_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "trt-spec")
    return Path(root)


def write_cache_file(path: Path, text: str) -> bool:
    """Best effort, for caches of measurements: `text` written whole beside `path`, then
    renamed onto it (a reader never sees half a file). False where it cannot be written (a
    read-only cache costs only a measurement again)."""
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name)
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
        return True
    except OSError:
        return False


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


def source_stamp(target: str | Path, draft_dir: str | Path) -> dict:
    """What a form derived from a target and our draft checkpoint was made from (the target's
    path, the draft's path and the sha256 of its weights); a different stamp means rebuild."""
    digest = hashlib.sha256((Path(draft_dir) / "model.safetensors").read_bytes()).hexdigest()
    return {"target": str(Path(target).resolve()), "draft": str(Path(draft_dir).resolve()),
            "draft_sha256": digest}
