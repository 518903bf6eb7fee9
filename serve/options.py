"""`trt-spec serve`'s own settings, beside the runtime's (RuntimeConfig): light, so the command
line reads its defaults without importing the server."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from trt_spec.runtime.options import option
from trt_spec.runtime.settings import DEFAULT_MAX_BODY_BYTES, RuntimeConfig


ROUTINGS = ("prefix", "load")  # serve --ray --routing
LOG_FORMATS = ("text", "json")  # serve --log-format (serve/logs.py)
ORIGIN = re.compile(r"https?://[^/\s]+")  # scheme://host[:port], no path


@dataclass(frozen=True)
class Access:
    """Who may call the server, checked on every request (serve/access.py): an API key that
    every route but /health (and /metrics, unless protect_metrics) requires as
    `Authorization: Bearer KEY`, and the browser origins CORS answers for."""

    api_key: str | None = field(default=None, repr=False)  # None: no key needed
    allowed_origins: tuple[str, ...] = ()  # "*": any; (): no CORS headers
    protect_metrics: bool = False  # /metrics needs the key too

    def __post_init__(self):
        key = self.api_key
        if key is not None and (not isinstance(key, str) or not key or key != key.strip()
                                or any(c.isspace() or not c.isprintable() for c in key)):
            raise ValueError("the API key must be a non-empty string of printable characters "
                             "without spaces (--api-key or TRT_SPEC_API_KEY)")
        origins = tuple(self.allowed_origins)
        for origin in origins:
            if origin != "*" and not ORIGIN.fullmatch(origin):
                raise ValueError(f"allowed origin {origin!r}: expected scheme://host[:port] "
                                 "(e.g. https://app.example.com, no path) or *")
        object.__setattr__(self, "allowed_origins", origins)
        if self.protect_metrics and key is None:
            raise ValueError("--protect-metrics needs an API key (--api-key or "
                             "TRT_SPEC_API_KEY)")


@dataclass(frozen=True)
class ConnectionLimits:
    """What one connection may hold of the server (serve/connection.py), so that a slow or
    idle client cannot keep sockets, buffers or tasks indefinitely. Times in seconds."""

    header_timeout: float = 10.0  # first byte of a request -> end of its headers; past it, 408
    body_timeout: float = 30.0  # end of the headers -> end of the body; past it, 408
    keep_alive_timeout: float = 5.0  # a connection idle between requests (or new) is closed
    max_header_bytes: int = 32 * 1024  # request line + headers; past it, 431
    max_connections: int = 512  # open connections; a new one past it gets a 503 and is closed
    max_concurrent_requests: int = 256  # requests in flight; past it, 503 (/health excepted)

    def __post_init__(self):
        for name in ("header_timeout", "body_timeout", "keep_alive_timeout"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"{name}={value!r}: must be a number of seconds > 0")
        for name in ("max_header_bytes", "max_connections", "max_concurrent_requests"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r}: must be an integer >= 1")


LIMITS = ConnectionLimits()


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
    api_key: str | None = field(default=None, repr=False)  # Access's fields, flat (the CLI's)
    allowed_origins: tuple[str, ...] = ()
    protect_metrics: bool = False
    reasoning_in_content: bool = False  # a thinking section stays in content (no split)
    docs: bool = False  # serve /docs, /redoc and /openapi.json
    header_timeout: float = LIMITS.header_timeout  # ConnectionLimits's fields, flat (the CLI's)
    body_timeout: float = LIMITS.body_timeout
    keep_alive_timeout: float = LIMITS.keep_alive_timeout
    max_header_bytes: int = LIMITS.max_header_bytes
    max_connections: int = LIMITS.max_connections
    max_concurrent_requests: int = LIMITS.max_concurrent_requests
    log_format: str = "text"  # the log's lines on stderr: text or json (serve/logs.py)
    access_log: bool = True  # a line per request (serve/request_log.py)

    def __post_init__(self):
        self.access, self.limits  # noqa: B018 - checked once, here
        if self.log_format not in LOG_FORMATS:
            raise ValueError(f"log_format {self.log_format!r}: expected one of "
                             f"{', '.join(LOG_FORMATS)}")

    @property
    def access(self) -> Access:
        return Access(self.api_key, self.allowed_origins, self.protect_metrics)

    @property
    def limits(self) -> ConnectionLimits:
        return ConnectionLimits(self.header_timeout, self.body_timeout, self.keep_alive_timeout,
                                self.max_header_bytes, self.max_connections,
                                self.max_concurrent_requests)

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
    routing: str = "prefix"  # a chat's turns to the replica holding them, or least loaded

    def __post_init__(self):
        if self.routing not in ROUTINGS:
            raise ValueError(f"--routing {self.routing!r}: expected one of "
                             f"{', '.join(ROUTINGS)}")
