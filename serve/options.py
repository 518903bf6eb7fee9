"""`trt-spec serve`'s own settings, beside the runtime's (RuntimeConfig): light, so the command
line reads its defaults without importing the server."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from trt_spec.runtime.options import option
from trt_spec.runtime.settings import DEFAULT_MAX_BODY_BYTES, RuntimeConfig


@dataclass(frozen=True)
class ServeOptions:
    """`trt-spec serve`'s options, shared by the single-process server (serve_engine) and the
    Ray Serve replicas (serve/ray_serve.py)."""

    engine: str
    runtime: RuntimeConfig  # the Generator's and Scheduler's settings (runtime/settings.py)
    host: str = "127.0.0.1"
    port: int = 8000
    served_model_name: str | None = None
    shutdown_timeout: float = 60.0
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    debug_step_delay: float = 0.0

    @property
    def model_name(self) -> str:
        """The model id clients send: --served-model-name, else the engine folder's name."""
        return self.served_model_name or Path(self.engine).resolve().name


@dataclass(frozen=True)
class RayOptions:
    """`trt-spec serve --ray`'s own options."""

    replicas: int = 1
    address: str | None = option(None, "ray_address")  # join this cluster; None: a local Ray
    min_replicas: int | None = None
    max_replicas: int | None = None
    target_ongoing_requests: float | None = None
    max_ongoing_requests: int | None = None  # None: --max-num-seqs
    replica_cpus: float = 1.0
    ship_engine: bool = False
    metrics_targets: str | None = None
    num_cpus: int | None = option(None, "ray_num_cpus")  # of the local Ray
