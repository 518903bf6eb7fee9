"""trt-spec: exported speculative decoding.

    from trt_spec import LLM, SamplingParams

The top-level import stays light: it must work in a runtime-only install (no torch), and
`LLM` / `SamplingParams` are imported on first use (the CLI does not pay for them).

This is also the package's edge, run before any of its modules: it registers the torch-cuda
backend, which runs the export modules, with the runtime's graph sources, so that the runtime
itself never imports export/ (runtime/backends/sources.py)."""

from trt_spec.runtime.backends.sources import register_graph_source

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "StreamDelta"]


def _torch_cuda(manifest, config):
    try:
        from trt_spec.export.torch_backend import graph_source
    except ImportError as e:
        raise ValueError(f"backend 'torch-cuda' needs torch ({e}); install the export "
                         "extra: pip install -e '.[export]'") from None
    return graph_source(manifest, config)


register_graph_source("torch-cuda", _torch_cuda)


def __getattr__(name):
    if name in ("LLM", "RequestOutput", "CompletionOutput", "StreamDelta"):
        from trt_spec.runtime import api

        return getattr(api, name)
    if name == "SamplingParams":
        from trt_spec.runtime.sampling import SamplingParams

        return SamplingParams
    raise AttributeError(f"module 'trt_spec' has no attribute {name!r}")
