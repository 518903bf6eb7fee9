"""The graph sources by backend name: what `RuntimeConfig.backend` picks.

    load_graphs(manifest, config) -> GraphSet      # ort | torch-cuda | trt

Each source imports its backend's module only when chosen, so this module is light: the package
imports it at its edge. "torch-cuda" runs the export modules and lives beside them
(export/torch_backend.py); trt_spec/__init__.py registers it here, so the runtime never
imports export/.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    from trt_spec.runtime.backends.base import GraphSet
    from trt_spec.runtime.manifest import Manifest
    from trt_spec.runtime.settings import RuntimeConfig

BACKENDS = ("ort", "torch-cuda", "trt")

Source = Callable[["Manifest", "RuntimeConfig"], "GraphSet"]


def _ort(manifest: Manifest, config: RuntimeConfig) -> GraphSet:
    from trt_spec.runtime.backends.ort import OrtGraphs

    # the exactness probe covers every slot verifying k drafts at once (k: the configured,
    # or auto's most if larger: a request may ask for it)
    from trt_spec.runtime.settings import AUTO_MAX_DRAFT_TOKENS

    k = max(config.speculation.num_draft_tokens, AUTO_MAX_DRAFT_TOKENS)
    return OrtGraphs(manifest, config.threads, config.exact_decode, (config.max_batch, k + 1))


def _trt(manifest: Manifest, config: RuntimeConfig) -> GraphSet:
    from trt_spec.runtime.backends.trt import TrtGraphs

    return TrtGraphs(manifest, config.device, config.cuda_graphs)


GRAPH_SOURCES: dict[str, Source] = {"ort": _ort, "trt": _trt}


def register_graph_source(name: str, source: Source) -> None:
    """Adds a backend by name (one of BACKENDS): source(manifest, config) -> GraphSet, raising
    ValueError in one line where the backend cannot run here."""
    if name not in BACKENDS:
        raise ValueError(f"backend={name!r}: expected one of {', '.join(BACKENDS)}")
    GRAPH_SOURCES[name] = source


def load_graphs(manifest: Manifest, config: RuntimeConfig) -> GraphSet:
    """The graph source of `config.backend`: "ort" (the folder's ONNX graphs), "torch-cuda" (the
    export modules, loaded from the folder's source checkpoint) or "trt" (the folder's
    TensorRT engines, `trt-spec build`). Where a backend cannot run here, one ValueError line
    says why and what to install."""
    if config.backend not in BACKENDS:
        raise ValueError(f"backend={config.backend!r}: expected one of {', '.join(BACKENDS)}")
    source = GRAPH_SOURCES.get(config.backend)
    if source is None:
        raise ValueError(f"backend={config.backend!r} is not registered in this install")
    return source(manifest, config)
