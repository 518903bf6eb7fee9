"""TensorRT backend: the built engines of a folder (`trt-spec build`) behind the backend
contract (runtime/backends/base.py); TrtTarget.run is one forward:

    run(cache, step, want):
        bucket  = plan_bucket(...); pad_feeds(...)
        profile = choose_profile(profiles, bucket)       # prefill or decode/verify
        bufs    = buffers[bucket]                        # preallocated torch CUDA tensors
        copy feeds into bufs (in place, on our stream)
        graph   = graphs[bucket, cache] or capture(execute_async_v3)   # lazily; else enqueue
        sync; logits (and wanted rows) -> host

Everything runs on one non-default CUDA stream. A CUDA graph is valid for one set of shapes and
addresses, so there is one per (profile, bucket, cache buffer), captured on first use after a
plain warm-up enqueue; when capture fails the bucket is enqueued plainly from then on.

`tensorrt` and torch are imported when a TrtGraphs is made (where they are missing, one
ValueError line says so): this module imports anywhere, and its pure parts (profile choice,
buffer shapes) are tested on a CPU. Caches are TorchKVCaches on the device. The folder's
"score" graph (the target with SpecVerify inside, for a device-resident loop) has no runtime
user yet.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np

from trt_spec.runtime.backends.base import GraphSet, StepGraph
from trt_spec.runtime.backends.buckets import Bucket, pad_feeds, plan_bucket
from trt_spec.runtime.config import ModelConfig
from trt_spec.runtime.graph_io import HIDDEN_INPUT, PAST, PRESENT, is_cache, kv_names
from trt_spec.runtime.kv_cache import KVCache
from trt_spec.runtime.manifest import EngineFolderError, Manifest
from trt_spec.runtime.step_inputs import StepInputs

SYMBOLS = ("batch", "new_tokens", "num_logits", "max_len")


def choose_profile(profiles: list[dict], bucket: Bucket) -> int:
    """The index of the first profile (manifest "trt" entry, in build order) whose input_ids
    range holds the bucket's (batch, new_tokens) and whose logits_index range holds
    num_logits; the decode profile is listed after prefill, so prefer the tighter one."""
    fits = []
    for i, p in enumerate(profiles):
        lo, _, hi = p["shapes"]["input_ids"]
        nlo, _, nhi = p["shapes"].get("logits_index", ((1, 1), None, (1 << 30, 1 << 30)))
        if (lo[0] <= bucket.batch <= hi[0] and lo[1] <= bucket.new_tokens <= hi[1]
                and nlo[1] <= bucket.num_logits <= nhi[1]):
            fits.append((hi[1], i))  # smallest new_tokens range first: decode before prefill
    if not fits:
        raise ValueError(f"no optimization profile holds batch {bucket.batch}, new_tokens "
                         f"{bucket.new_tokens}, num_logits {bucket.num_logits}; rebuild with "
                         "larger --max-batch / --max-draft-tokens / --max-prefill")
    return min(fits)[1]


def resolve_shape(shape: list, bucket: Bucket, max_len: int) -> tuple[int, ...]:
    """A manifest shape (ints and symbols) at a bucket's sizes."""
    sizes = {"batch": bucket.batch, "new_tokens": bucket.new_tokens,
             "num_logits": bucket.num_logits, "max_len": max_len}
    out = []
    for d in shape:
        if isinstance(d, int):
            out.append(d)
        elif d in sizes:
            out.append(sizes[d])
        else:
            raise ValueError(f"shape {shape}: unknown symbol {d!r}; known {SYMBOLS}")
    return tuple(out)


def buffer_shapes(inputs: list[dict], outputs: list[dict], bucket: Bucket,
                  max_len: int) -> dict[str, tuple[int, ...]]:
    """Shapes of the per-bucket buffers: every input and output except the KV cache (past and
    present are views of the cache, bound in place)."""
    return {t["name"]: resolve_shape(t["shape"], bucket, max_len) for t in inputs + outputs
            if not is_cache(t["name"])}


TORCH_DTYPES = {"float32": "float32", "float16": "float16", "bfloat16": "bfloat16",
                "int64": "int64", "int32": "int32", "bool": "bool"}


class TrtTarget(StepGraph):
    """One engine with the step contract of export/model.py or export/drafters.py.

    graph: the manifest's graph entry (inputs / outputs); engine: its "trt" engines entry."""

    def __init__(self, folder: Path, graph: dict, engine: dict, num_layers: int,
                 max_positions: int, cuda_graphs: bool = True, device: str = "cuda"):
        import tensorrt as trt
        import torch

        self.torch, self.trt = torch, trt
        self.device = torch.device(device)
        self.logger = trt.Logger(trt.Logger.WARNING)
        runtime = trt.Runtime(self.logger)
        self.engine = runtime.deserialize_cuda_engine((Path(folder) / engine["file"]).read_bytes())
        if self.engine is None:
            raise RuntimeError(f"TensorRT cannot load {engine['file']} (built by another "
                               "version or for another GPU? rebuild with `trt-spec build`)")
        self.stream = torch.cuda.Stream(self.device)  # never the default stream
        self.profiles = engine["profiles"]
        self.contexts = []  # one execution context per profile
        for i in range(len(self.profiles)):
            ctx = self.engine.create_execution_context()
            ctx.set_optimization_profile_async(i, self.stream.cuda_stream)
            self.contexts.append(ctx)
        self.inputs, self.outputs_spec = graph["inputs"], graph["outputs"]
        self.num_layers = num_layers
        self.max_positions = max_positions
        self.past_names = kv_names(num_layers, PAST)
        self.present_names = kv_names(num_layers, PRESENT)
        self.takes_hidden = any(t["name"] == HIDDEN_INPUT for t in self.inputs)
        self.outputs = [t["name"] for t in self.outputs_spec
                        if t["name"] != "logits" and t["name"] not in self.present_names]
        self.dtypes = {t["name"]: getattr(torch, TORCH_DTYPES[t["dtype"]])
                       for t in self.inputs + self.outputs_spec}
        self.cuda_graphs = cuda_graphs
        self.buffers: dict[Bucket, dict] = {}
        self.graphs: dict[tuple, object] = {}
        self.failed: dict[tuple, str] = {}
        self.stats = {"enqueued": 0, "captured": 0, "replayed": 0, "capture_failed": 0}

    def _bind(self, ctx, bucket: Bucket, bufs: dict, views: list) -> None:
        for name, tensor in bufs.items():
            if name in {t["name"] for t in self.inputs}:
                ctx.set_input_shape(name, tuple(tensor.shape))
            ctx.set_tensor_address(name, tensor.data_ptr())
        for past, present, view in zip(self.past_names, self.present_names, views):
            ctx.set_input_shape(past, tuple(view.shape))
            ctx.set_tensor_address(past, view.data_ptr())  # past and present: one buffer
            ctx.set_tensor_address(present, view.data_ptr())

    def _enqueue(self, ctx) -> None:
        if not ctx.execute_async_v3(self.stream.cuda_stream):
            raise RuntimeError("TensorRT execute_async_v3 failed (see its log)")

    def run(self, cache: KVCache, step: StepInputs,
            want: tuple[str, ...]) -> tuple[np.ndarray, dict[str, np.ndarray], int]:
        torch = self.torch
        batch, new_tokens = step.feeds["input_ids"].shape
        bucket = plan_bucket(step.lo, step.hi, new_tokens, step.feeds["logits_index"].shape[1],
                             cache.slots, self.takes_hidden)
        if bucket is None:  # longer than the largest token bucket: exact shapes, no graph
            bucket = Bucket(step.lo, step.hi - step.lo, new_tokens,
                            step.feeds["logits_index"].shape[1], self.takes_hidden)
            graphable = False
        else:
            graphable = self.cuda_graphs
        feeds = pad_feeds(step.feeds, cache.lengths, step.lo, bucket)
        index = choose_profile(self.profiles, bucket)
        ctx = self.contexts[index]
        bufs = self.buffers.get(bucket)
        if bufs is None:
            shapes = buffer_shapes(self.inputs, self.outputs_spec, bucket, cache.max_len)
            bufs = self.buffers[bucket] = {
                n: torch.empty(s, dtype=self.dtypes[n], device=self.device)
                for n, s in shapes.items()}
        views = cache.views(bucket.lo, bucket.hi)
        with torch.cuda.stream(self.stream):
            for name, value in feeds.items():  # inputs written in place
                bufs[name].copy_(torch.from_numpy(value), non_blocking=False)
            key = (index, bucket, views[0].data_ptr())
            graph = self.graphs.get(key)
            if graph is not None:
                graph.replay()
                self.stats["replayed"] += 1
            else:
                self._bind(ctx, bucket, bufs, views)
                self._enqueue(ctx)  # this step's result; also the warm-up before capture
                self.stats["enqueued"] += 1
                if graphable and key not in self.failed:
                    self._capture(key, ctx)
        self.stream.synchronize()
        rows = {name: bufs[name].float().cpu().numpy() for name in want}
        return bufs["logits"].float().cpu().numpy(), rows, bucket.lo

    def _capture(self, key: tuple, ctx) -> None:
        """Captures ctx's enqueue for replay; re-running this step is idempotent (the cache
        rows it writes depend only on the inputs and the rows before them)."""
        torch = self.torch
        try:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=self.stream):
                self._enqueue(ctx)
            self.graphs[key] = graph
            self.stats["captured"] += 1
        except Exception as e:  # noqa: BLE001 - this bucket is enqueued plainly from now on
            self.failed[key] = f"{type(e).__name__}: {e}"
            self.stats["capture_failed"] += 1
            warnings.warn(f"CUDA graph capture of a TensorRT enqueue failed ({self.failed[key]});"
                          " enqueueing that bucket plainly", RuntimeWarning, stacklevel=3)


def trt_graph_names(manifest_data: dict) -> list[str]:
    """The graphs that have a built engine."""
    return sorted(manifest_data.get("trt", {}).get("engines", {}))


def require_tensorrt_runtime():
    """The tensorrt module and torch with CUDA, or ValueError in one line saying what is
    missing and how to get it."""
    try:
        import tensorrt  # noqa: F401
    except ImportError as e:
        raise ValueError(f"backend 'trt' needs TensorRT, which is not installed here ({e}); it "
                         "runs on a CUDA machine with `pip install tensorrt` and an engine "
                         "folder built by `trt-spec build`") from None
    try:
        import torch
    except ImportError as e:
        raise ValueError(f"backend 'trt' needs torch with CUDA ({e})") from None
    if not torch.cuda.is_available():
        raise ValueError("backend 'trt' needs a CUDA GPU; torch sees none")
    return tensorrt


class TrtGraphs(GraphSet):
    """The TensorRT engines of a folder (`trt-spec build`), by manifest graph name; caches are
    TorchKVCaches on the device."""

    backend = "trt"

    def __init__(self, manifest: Manifest, device: str | None = None, cuda_graphs: bool = True):
        require_tensorrt_runtime()
        super().__init__(manifest)
        self.engines = manifest.data.get("trt", {}).get("engines", {})
        if not self.engines:
            raise EngineFolderError(f"{manifest.folder}: no TensorRT engine is built here; run "
                                    f"`trt-spec build --engine {manifest.folder}` first")
        self.device = device or "cuda"
        self.cuda_graphs = cuda_graphs

    def _engine(self, name: str) -> dict:
        if name not in self.engines:
            raise EngineFolderError(f"{self.manifest.folder}: graph {name!r} has no TensorRT "
                                    f"engine; built: {sorted(self.engines)}")
        return self.engines[name]

    def step_graph(self, name: str, config: ModelConfig) -> TrtTarget:
        return TrtTarget(self.manifest.folder, self.manifest.graph(name), self._engine(name),
                         config.num_layers, config.max_position_embeddings, self.cuda_graphs,
                         self.device)

    def function(self, name: str):
        """A graph without a cache (Eagle3's fc: two MatMuls, no plugin) runs on ONNX
        Runtime from its ONNX file."""
        from trt_spec.runtime.backends.ort import OrtFunction

        return OrtFunction(self.manifest.path(self.manifest.graph(name)["files"][0]))

    def cache(self, config: ModelConfig, slots: int, max_len: int) -> KVCache:
        import torch

        from trt_spec.runtime.backends.torch_cache import TorchKVCache

        return TorchKVCache(config, slots, max_len, torch.device(self.device))
