"""trt-spec: exported speculative decoding.

    from trt_spec import LLM, SamplingParams

The top-level import stays light: it must work in a runtime-only install (no torch), and
`LLM` / `SamplingParams` are imported on first use (the CLI does not pay for them)."""

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput"]


def __getattr__(name):
    if name in ("LLM", "RequestOutput", "CompletionOutput"):
        from trt_spec.runtime import api

        return getattr(api, name)
    if name == "SamplingParams":
        from trt_spec.runtime.sampling import SamplingParams

        return SamplingParams
    raise AttributeError(f"module 'trt_spec' has no attribute {name!r}")
