"""`trt-spec serve --ray`: the engine folder as a Ray Serve application.

    client ──HTTP──> Ray Serve proxy (one per node, --port) ──> PrefixIngress ──> replica 1..N
                     (--routing load: the proxy hands requests to the replicas itself)  │
    replica = EngineReplica: its own Generator + Scheduler (background thread) and the same
              FastAPI app as `trt-spec serve` (server.create_app), which the ingress relays
              requests to (HttpEngineReplica, bound with serve.ingress, under --routing load);
              its own Prometheus registry, exported on its own port (a scrape target)

Routing (`routing`): "prefix" (the default) reads each request's body in a small ingress and
sends a chat's every turn to the replica that holds its earlier turns (serve/ray_routing.py);
"load" lets the proxy hand requests to the less loaded of two replicas. Either way at most
`max_ongoing_requests` per replica; Ray Serve does the autoscaling (`autoscaling_config`) and
replaces a replica that dies.

The engine folder reaches a replica in one of two ways (`EngineSource`):
    path          the folder is at the same path on every node (a shared or copied disk)
    object store  the driver puts the folder's files in Ray's object store once; each replica
                  writes them to a local cache folder named by the manifest digest
Either way the replica loads the manifest with sha256 verification of every file and, given
`engine_checksum`, refuses a manifest whose digest differs.

Metrics: each replica serves its registry on http://<node ip>:<free port>/metrics and
registers it (with its replica id and pid) in a small named actor, `ReplicaDirectory`; the
driver writes the live ones as a Prometheus file_sd targets file, the way Ray publishes its
own metrics endpoints (prom_metrics_service_discovery.json).

Ray is imported here only; `trt-spec serve --ray` imports this module lazily.
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import signal
import tempfile
import threading
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import ray
from ray import serve

from trt_spec.runtime.manifest import MANIFEST, load_manifest, manifest_digest
from trt_spec.runtime.settings import DEFAULT_MAX_BODY_BYTES, RuntimeConfig
from trt_spec.serve.asgi_relay import run_asgi
from trt_spec.serve.options import ROUTINGS, Access, RayOptions, ServeOptions

log = logging.getLogger("trt_spec.ray_serve")
APP_NAME = "trt-spec"
DEPLOYMENT_NAME = "EngineReplica"
DIRECTORY_NAME = "trt_spec_replica_directory"
NAMESPACE = "trt_spec"


@dataclass(frozen=True)
class ReplicaConfig:
    """What every replica builds: `trt-spec serve`'s options, one to one."""

    model_name: str
    # the runtime settings (every file's checksum verified on load; one ORT thread unless
    # --threads: replicas, not threads, add cores)
    runtime: RuntimeConfig = RuntimeConfig(verify="sha256", threads=1)
    debug_step_delay: float = 0.0
    engine_checksum: str | None = None  # manifest digest every replica must match
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    access: Access = Access()  # the API key and CORS origins, as `trt-spec serve`'s
    reasoning_in_content: bool = False
    docs: bool = False  # /docs, /redoc, /openapi.json
    log_format: str = "text"  # the replica's log lines (serve/logs.py)
    access_log: bool = True  # a line per request (serve/request_log.py)


@dataclass(frozen=True)
class ScalingConfig:
    """Maps onto Ray Serve's deployment options: a fixed `replicas`, or autoscaling between
    `min_replicas` and `max_replicas` aiming at `target_ongoing_requests` per replica."""

    replicas: int = 1
    min_replicas: int | None = None
    max_replicas: int | None = None
    target_ongoing_requests: float | None = None
    max_ongoing_requests: int = 8  # per replica; more wait in Ray Serve's router
    replica_cpus: float = 1.0
    shutdown_timeout: float = 60.0

    def __post_init__(self):
        if self.replicas < 1:
            raise ValueError(f"replicas={self.replicas}: must be >= 1")
        auto = (self.min_replicas, self.max_replicas, self.target_ongoing_requests)
        if any(v is not None for v in auto):
            lo = self.min_replicas if self.min_replicas is not None else 1
            hi = self.max_replicas if self.max_replicas is not None else max(lo, self.replicas)
            if not 0 <= lo <= hi or hi < 1:
                raise ValueError(f"min_replicas={lo}, max_replicas={hi}: need 0 <= min <= max "
                                 "and max >= 1")

    @property
    def autoscaling(self) -> bool:
        return any(v is not None for v in
                   (self.min_replicas, self.max_replicas, self.target_ongoing_requests))

    def deployment_options(self) -> dict:
        options = {"max_ongoing_requests": self.max_ongoing_requests,
                   "ray_actor_options": {"num_cpus": self.replica_cpus},
                   "graceful_shutdown_timeout_s": self.shutdown_timeout}
        if not self.autoscaling:
            return {**options, "num_replicas": self.replicas}
        lo = self.min_replicas if self.min_replicas is not None else 1
        hi = self.max_replicas if self.max_replicas is not None else max(lo, self.replicas)
        auto = {"min_replicas": lo, "max_replicas": hi,
                "initial_replicas": min(max(self.replicas, lo), hi)}
        if self.target_ongoing_requests is not None:
            auto["target_ongoing_requests"] = self.target_ongoing_requests
        return {**options, "autoscaling_config": auto}


@dataclass
class EngineSource:
    """The engine folder as a replica finds it: `path` on its node, or `files` (an object
    store reference to {name: bytes}) written to a local cache folder first."""

    path: str | None = None
    files: object = None  # ray.ObjectRef to dict[str, bytes]
    digest: str = ""
    name: str = ""

    @classmethod
    def from_path(cls, folder: str | Path) -> "EngineSource":
        folder = Path(folder).resolve()
        return cls(path=str(folder), digest=manifest_digest(folder), name=folder.name)

    @classmethod
    def via_object_store(cls, folder: str | Path) -> "EngineSource":
        """Checks the folder here (sha256), then puts its files in the object store."""
        folder = Path(folder).resolve()
        manifest = load_manifest(folder, verify="sha256")
        names = [MANIFEST, *manifest.data["files"]]
        files = {n: (folder / n).read_bytes() for n in names}
        return cls(files=ray.put(files), digest=manifest_digest(folder), name=folder.name)

    def materialize(self) -> Path:
        """The folder on this node (written once per digest for the object-store form)."""
        if self.files is None:
            return Path(self.path)
        root = Path(os.environ.get("TRT_SPEC_ENGINE_CACHE",
                                   Path(tempfile.gettempdir()) / "trt-spec-engines"))
        folder = root / f"{self.name}-{self.digest[:16]}"
        if not (folder / MANIFEST).is_file():
            files = ray.get(self.files)
            root.mkdir(parents=True, exist_ok=True)
            tmp = Path(tempfile.mkdtemp(prefix=f"{self.name}-", dir=root))
            for name, data in files.items():
                (tmp / name).parent.mkdir(parents=True, exist_ok=True)
                (tmp / name).write_bytes(data)
            try:
                tmp.rename(folder)  # atomic: another replica on this node may race us
            except OSError:  # it won; its copy is checked (sha256) like ours would be
                shutil.rmtree(tmp)
        return folder


@ray.remote(num_cpus=0)
class ReplicaDirectory:
    """Where each replica says where its /metrics is (and its pid, for operators)."""

    def __init__(self):
        self.replicas: dict[str, dict] = {}

    def register(self, replica_id: str, info: dict) -> None:
        self.replicas[replica_id] = info

    def unregister(self, replica_id: str) -> None:
        self.replicas.pop(replica_id, None)

    def list(self) -> dict[str, dict]:
        return dict(self.replicas)


class EngineReplica:
    """One engine and its scheduler; requests reach it through server.create_app's routes,
    relayed by the prefix-routing ingress (`relay`; routing "prefix") or straight from the
    proxy (HttpEngineReplica; routing "load")."""

    serves_http = False  # the proxy's own target (serve.ingress runs the app's lifespan)

    def __init__(self, source: EngineSource, config: ReplicaConfig):
        from prometheus_client import start_http_server

        from trt_spec.runtime.generator import Generator
        from trt_spec.runtime.scheduler import Scheduler
        from trt_spec.serve.logs import configure_logging
        from trt_spec.serve.server import create_app

        configure_logging(config.log_format, config.access_log)
        folder = source.materialize()
        digest = manifest_digest(folder)
        want = config.engine_checksum or source.digest
        if digest != want:
            raise ValueError(f"{folder / MANIFEST}: sha256 {digest}, expected {want}: this node "
                             "has another export of the engine folder")
        gen = Generator(folder, config.runtime)
        gen.cache.reserve()  # resident from the start, as the single-process server's
        self.scheduler = Scheduler(gen, config.debug_step_delay)
        self.http_app = create_app(self.scheduler, config.model_name,
                                   start_loop=self.serves_http,  # else: started here
                                   max_body_bytes=config.max_body_bytes, access=config.access,
                                   reasoning_in_content=config.reasoning_in_content,
                                   docs=config.docs, access_log=config.access_log,
                                   echo_request_id=False)  # the proxy's x-request-id
        if not self.serves_http:
            self.scheduler.start()
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        host = ray.util.get_node_ip_address()
        registry = self.http_app.state.served.metrics.registry
        self._metrics_server, _ = start_http_server(0, addr=host, registry=registry)
        self.metrics_url = f"http://{host}:{self._metrics_server.server_port}/metrics"
        self.info = {"metrics_url": self.metrics_url, "pid": os.getpid(), "node_ip": host,
                     "engine": str(folder), "manifest_sha256": digest}
        try:
            ray.get(ray.get_actor(DIRECTORY_NAME, namespace=NAMESPACE)
                    .register.remote(self.replica_id, self.info))
        except ValueError:  # deployed without the CLI's directory: metrics still served
            log.warning("no %s actor: replica %s metrics at %s are not listed",
                        DIRECTORY_NAME, self.replica_id, self.metrics_url)

    async def relay(self, head: dict, body: bytes, key: str | None = None):
        """One HTTP request from the prefix-routing ingress, answered as it is written
        (serve/asgi_relay.py). `key` is for the router (serve/ray_routing.py), not the app."""
        async for part in run_asgi(self.http_app, head, body):
            yield part

    async def __del__(self):
        # Ray Serve's graceful shutdown (scale down, redeploy); a killed process never gets
        # here, so readers of the directory probe the endpoints (live_targets).
        server = getattr(self, "_metrics_server", None)
        if server is not None:
            server.shutdown()
        try:
            ray.get_actor(DIRECTORY_NAME, namespace=NAMESPACE).unregister.remote(self.replica_id)
        except (ValueError, RuntimeError) as e:  # no directory, or the cluster is going down
            log.info("replica %s not unregistered: %s", self.replica_id, e)
        if self.serves_http:
            await super().__del__()  # the app's lifespan: stops the scheduler
        elif hasattr(self, "scheduler"):
            self.scheduler.stop(timeout=30)


@serve.ingress()
class HttpEngineReplica(EngineReplica):
    """EngineReplica as the application's HTTP entry (routing "load")."""

    serves_http = True

    def __serve_build_asgi_app__(self):
        return self.http_app


def build_app(source: EngineSource, config: ReplicaConfig, scaling: ScalingConfig,
              routing: str = "prefix"):
    """The Ray Serve application: EngineReplica with `scaling`'s deployment options, behind
    the prefix-routing ingress (routing "prefix") or the proxy alone ("load")."""
    if routing not in ROUTINGS:
        raise ValueError(f"routing {routing!r}: expected one of {', '.join(ROUTINGS)}")
    options = scaling.deployment_options()
    if routing == "load":
        return serve.deployment(HttpEngineReplica, name=DEPLOYMENT_NAME,
                                **options).bind(source, config)
    from ray.serve.config import RequestRouterConfig

    from trt_spec.serve import ray_routing

    options["request_router_config"] = RequestRouterConfig(
        request_router_class=ray_routing.ROUTER_CLASS)
    engine = serve.deployment(EngineReplica, name=DEPLOYMENT_NAME, **options).bind(source,
                                                                                  config)
    return ray_routing.ingress_deployment().bind(engine)


@dataclass
class RayDeployment:
    """A running application and what the driver keeps for it."""

    url: str
    directory: object  # ReplicaDirectory handle
    started_ray: bool
    targets_file: Path | None = None
    _last: list = field(default_factory=list)

    def live_targets(self, timeout: float = 1.0) -> list[dict]:
        """Prometheus file_sd entries for the replicas whose /metrics answers."""
        out = []
        for replica_id, info in sorted(ray.get(self.directory.list.remote()).items()):
            try:
                with urllib.request.urlopen(info["metrics_url"], timeout=timeout) as r:
                    ok = r.status == 200
            except OSError:  # refused, timed out (URLError and HTTPError are OSErrors)
                ok = False
            if not ok:
                self.directory.unregister.remote(replica_id)  # died without __del__
                continue
            host_port = info["metrics_url"].split("//", 1)[1].rsplit("/", 1)[0]
            out.append({"targets": [host_port],
                        "labels": {"replica": replica_id, "pid": str(info["pid"]),
                                   "app": APP_NAME, "manifest_sha256": info["manifest_sha256"]}})
        return out

    def write_targets(self) -> list[dict]:
        targets = self.live_targets()
        if self.targets_file is not None and targets != self._last:
            tmp = self.targets_file.with_suffix(".tmp")
            tmp.write_text(json.dumps(targets, indent=2) + "\n")
            tmp.replace(self.targets_file)  # Prometheus never reads half a file
            self._last = targets
        return targets

    def shutdown(self) -> None:
        serve.shutdown()
        if self.started_ray:
            ray.shutdown()


def deploy(source_folder: str, config: ReplicaConfig, scaling: ScalingConfig, host: str,
           port: int, address: str | None = None, ship_engine: bool = False,
           targets_file: str | None = None, num_cpus: int | None = None,
           routing: str = "prefix", keep_alive_timeout: float | None = None,
           stop: threading.Event | None = None) -> RayDeployment:
    """Joins the cluster at `address` (or starts a local Ray), runs the application behind
    Ray Serve's HTTP proxy on host:port, and returns once every replica is up.
    keep_alive_timeout: the proxy's idle keep-alive (whole seconds; None: Ray's default);
    the proxy has no header or body timeout of its own to set. stop: set by a SIGTERM from
    ray.init on (whose own handler exits with status 15: the proxy may already answer while
    the last replica starts, and a client's SIGTERM then found Ray's)."""
    started = not ray.is_initialized()
    if started:
        kw = {"address": address} if address else {"num_cpus": num_cpus,
                                                   "include_dashboard": False}
        ray.init(namespace=NAMESPACE, logging_level=logging.WARNING, **kw)
    if stop is not None:
        signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        source = (EngineSource.via_object_store(source_folder) if ship_engine
                  else EngineSource.from_path(source_folder))
        if config.engine_checksum and source.digest != config.engine_checksum:
            raise ValueError(f"{Path(source_folder) / MANIFEST}: sha256 {source.digest}, "
                             f"--engine-checksum {config.engine_checksum}")
        directory = ReplicaDirectory.options(name=DIRECTORY_NAME, namespace=NAMESPACE,
                                             get_if_exists=True).remote()
        http = {"host": host, "port": port}
        if keep_alive_timeout is not None:
            http["keep_alive_timeout_s"] = max(1, math.ceil(keep_alive_timeout))
        serve.start(http_options=http)
        serve.run(build_app(source, config, scaling, routing), name=APP_NAME, route_prefix="/")
    except Exception:
        if started:
            ray.shutdown()
        raise
    d = RayDeployment(f"http://{host}:{port}", directory, started,
                      Path(targets_file) if targets_file else None)
    d.write_targets()
    return d


class DeploymentError(RuntimeError):
    """Ray Serve could not start the application (Ray wraps a replica's error)."""


def replica_config(options: ServeOptions, engine_checksum: str | None = None) -> ReplicaConfig:
    """What each replica builds from `serve`'s options: one ORT thread unless --threads."""
    runtime = options.runtime.replace(verify="sha256", threads=options.runtime.threads or 1)
    return ReplicaConfig(model_name=options.model_name, runtime=runtime,
                         debug_step_delay=options.debug_step_delay,
                         engine_checksum=engine_checksum, max_body_bytes=options.max_body_bytes,
                         access=options.access,
                         reasoning_in_content=options.reasoning_in_content, docs=options.docs,
                         log_format=options.log_format, access_log=options.access_log)


def scaling_config(options: ServeOptions, ray_options: RayOptions) -> ScalingConfig:
    return ScalingConfig(
        replicas=ray_options.replicas, min_replicas=ray_options.min_replicas,
        max_replicas=ray_options.max_replicas,
        target_ongoing_requests=ray_options.target_ongoing_requests,
        max_ongoing_requests=ray_options.max_ongoing_requests or options.runtime.max_batch,
        replica_cpus=ray_options.replica_cpus, shutdown_timeout=options.shutdown_timeout)


def check_engine(engine: str, checksum: str | None) -> None:
    """The driver checks the folder first: a bad one fails here, not in N replicas (which
    check it again, sha256 and all, on their own node)."""
    load_manifest(engine, verify="size")
    if checksum and manifest_digest(engine) != checksum:
        raise ValueError(f"{engine}/manifest.json: sha256 {manifest_digest(engine)}, "
                         f"--engine-checksum {checksum}: another export of the engine folder")


def serve_on_ray(options: ServeOptions, ray_options: RayOptions,
                 engine_checksum: str | None = None, say=print) -> None:
    """`trt-spec serve --ray`: checks the engine folder, deploys, then keeps the metrics
    targets file current until SIGINT / SIGTERM, and shuts the deployment down. `say` gets
    what is deployed where. ValueError for a bad folder or setting (before Ray starts);
    DeploymentError when Ray Serve cannot start it."""
    config = replica_config(options, engine_checksum)
    scaling = scaling_config(options, ray_options)
    check_engine(options.engine, engine_checksum)
    name, address = config.model_name, ray_options.address
    where = f"the Ray cluster at {address}" if address else "a local Ray"
    say(f"deploying {name} ({options.engine}) on {where}, routing by {ray_options.routing}: "
        f"{scaling.deployment_options()}")
    stop = threading.Event()  # a SIGTERM while deploying: shut down once it is up
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        deployment = deploy(options.engine, config, scaling, options.host, options.port,
                            address, ray_options.ship_engine, ray_options.metrics_targets,
                            ray_options.num_cpus, ray_options.routing,
                            options.keep_alive_timeout, stop)
    except Exception as e:  # noqa: BLE001 - Ray wraps a replica's error; say it in one line
        raise DeploymentError(f"the Ray Serve deployment failed: {e}") from e
    for sig in (signal.SIGINT, signal.SIGTERM):  # (SIGINT while deploying: it stops there)
        signal.signal(sig, lambda *_: stop.set())
    say(f"serving {name} on {deployment.url} ({len(deployment.live_targets())} replicas up)")
    try:
        while not stop.wait(2.0):
            deployment.write_targets()
    finally:
        deployment.shutdown()
