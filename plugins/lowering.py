"""Which backend the graph being traced is lowered for: "ort" (default) or "trt".

Export modules call the ops in plugins/ without knowing the backend; each op reads
`current()` while it is traced and emits its ONNX Runtime form or its TensorRT form. The
choice is made once, around the trace (`with lowering("trt"): export_target(...)`), so the
modules stay free of backend branches and the traced graph stays a pure function.
"""

from __future__ import annotations

import contextlib
import contextvars

LOWERINGS = ("ort", "trt")
_current: contextvars.ContextVar[str] = contextvars.ContextVar("trt_spec_lowering", default="ort")


def current() -> str:
    return _current.get()


@contextlib.contextmanager
def lowering(backend: str):
    if backend not in LOWERINGS:
        raise ValueError(f"lowering {backend!r} is not known; choose from {LOWERINGS}")
    token = _current.set(backend)
    try:
        yield
    finally:
        _current.reset(token)
