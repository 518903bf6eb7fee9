"""Run a snippet in a fresh interpreter where importing torch or transformers fails, and
check afterwards that neither was imported."""

from __future__ import annotations

import subprocess
import sys
import textwrap

GUARD = """
import builtins, sys
real_import = builtins.__import__
def guarded(name, *args, **kwargs):
    if name.split(".")[0] in ("torch", "transformers"):
        raise ImportError(f"{name} is blocked in this test")
    return real_import(name, *args, **kwargs)
builtins.__import__ = guarded
"""
CHECK = """
assert not any(m.split(".")[0] in ("torch", "transformers") for m in sys.modules)
print("ok")
"""


def run_without_torch(body: str) -> None:
    """Asserts that `body` (dedented) runs to the end with torch and transformers blocked."""
    code = GUARD + textwrap.dedent(body) + CHECK
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"
