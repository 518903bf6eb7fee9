"""trt-spec: exported speculative decoding.

The top-level import stays light: it must work in a runtime-only install (no torch)."""

__version__ = "0.1.0"
