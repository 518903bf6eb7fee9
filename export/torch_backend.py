"""torch-cuda backend: the export modules (export/model.py, export/drafters.py) run with torch on
a device, with preallocated KV buffers and one CUDA graph per shape bucket. The runnable twin of
the trt backend (runtime/backends/trt.py): the same step() contract, the same buckets
(runtime/backends/buckets.py), the same in-place cache (runtime/backends/torch_cache.py).

It lives beside the modules it runs, not in runtime/: the runtime never imports export/. The
package's edge (trt_spec/__init__.py) registers it by name with the runtime's graph sources
(runtime/backends/sources.py), so `backend="torch-cuda"` reaches it from every entry point.

    step(cache, requests, want):
        feeds  = build_step_inputs(...)                 # NumPy, as for ORT
        bucket = plan_bucket(...)                       # (slots range, Tb, Nb); None: eager
        feeds  = pad_feeds(feeds, bucket)               # idle rows, right-padded tokens
        graph  = graphs[bucket] or capture(bucket)      # lazily, once per bucket
        copy feeds into the bucket's static inputs; graph.replay()
        logits (and wanted rows) -> host

Weights come from the engine folder's source checkpoint (manifest "source": the same model,
draft and heads the ONNX graphs were traced from, loaded by export/pipeline.py load_models), or
straight from a model (`TorchGraphs.from_model`). Both reuse the strict loaders, so the modules
are the ones the graphs were exported from: no second weight format to keep in sync.

The attention of these modules is swapped for `attention_in_place`: the same semantics as
plugins/attention.py's reference, but shape-static (no per-row Python loop, no host sync) so a
CUDA graph can capture it, and writing the new keys/values into the cache in place.
"""

from __future__ import annotations

import dataclasses
import warnings
from pathlib import Path

import numpy as np
import torch

from trt_spec.plugins.attention import Heads, heads_with_rope
from trt_spec.runtime.backends.base import DeviceGraphs, DeviceRunner, GraphSet, StepGraph
from trt_spec.runtime.backends.buckets import Bucket, exact_bucket, pad_feeds, plan_bucket
from trt_spec.runtime.backends.torch_cache import TorchKVCache
from trt_spec.runtime.config import ModelConfig
from trt_spec.runtime.graph_io import HIDDEN_INPUT, STEP_INPUTS
from trt_spec.runtime.kv_cache import KVCache
from trt_spec.runtime.manifest import EngineFolderError, Manifest
from trt_spec.runtime.methods import METHODS, DrafterEntry
from trt_spec.runtime.step_inputs import StepInputs


def attention_in_place(qkv, past_key, past_value, seqlens_k, query_seqlens, position_ids,
                       total_sequence_length, cos_cache, sin_cache, heads: Heads):
    """plugins.attention.attention_reference's semantics, shape-static and in place.

    qkv [batch, new_tokens, (num_heads + 2 kv_heads) head_dim]; past_key / past_value
    [batch, kv_heads, max_len + 1, head_dim]: the last row is a scratch row that padding
    tokens (s >= query_seqlens[b]) write to, so every write is a scatter of fixed shape and
    no valid row is touched by padding. Returns (output [batch, new_tokens, num_heads
    head_dim], past_key, past_value) (the caches, updated). Padding rows of the output are
    unspecified (finite). total_sequence_length is not needed. heads.window > 0: a sliding
    window, keys row - window < j <= row (the reference's rule)."""
    num_heads, kv_heads, window = heads
    batch, new_tokens, _ = qkv.shape
    head_dim = past_key.shape[-1]
    max_len = past_key.shape[2] - 1  # row max_len: scratch
    q, k, v = heads_with_rope(qkv, position_ids, cos_cache, sin_cache, heads, head_dim)

    total = seqlens_k.long() + 1  # (B,) rows valid after this step
    past = total - query_seqlens.long()  # (B,) rows valid before
    s = torch.arange(new_tokens, device=qkv.device)  # (T,)
    row = past[:, None] + s[None, :]  # (B, T) cache row of each new token
    dest = torch.where(s[None, :] < query_seqlens.long()[:, None], row, max_len)  # (B, T)
    index = dest[:, None, :, None].expand(batch, kv_heads, new_tokens, head_dim)
    past_key.scatter_(2, index, k)
    past_value.scatter_(2, index, v)

    group = num_heads // kv_heads  # query head h reads kv head h // group
    keys = past_key[:, :, :max_len]  # (B, kvh, L, hd) a view: no copy
    values = past_value[:, :, :max_len]
    qg = q.reshape(batch, kv_heads, group * new_tokens, head_dim)
    scores = (qg @ keys.transpose(-1, -2) / head_dim**0.5)  # (B, kvh, g T, L)
    scores = scores.view(batch, kv_heads, group, new_tokens, max_len)
    cols = torch.arange(max_len, device=qkv.device)
    allowed = cols[None, None, :] <= row[:, :, None]  # (B, T, L) lower-right causal
    if window > 0:
        allowed = allowed & (row[:, :, None] - cols[None, None, :] < window)
    scores = scores.masked_fill(~allowed[:, None, None], float("-inf"))
    out = scores.softmax(dim=-1) @ values[:, :, None]  # (B, kvh, g, T, hd)
    out = out.reshape(batch, num_heads, new_tokens, head_dim).transpose(1, 2)
    return out.reshape(batch, new_tokens, num_heads * head_dim), past_key, past_value


def use_in_place_attention(module: torch.nn.Module) -> torch.nn.Module:
    """Every decoder layer of `module` (target, draft or drafter step) attends in place."""
    from trt_spec.export.model import DecoderLayer

    for m in module.modules():
        if isinstance(m, DecoderLayer):
            m.attention_op = attention_in_place
    return module


class TorchTarget(StepGraph, DeviceRunner):
    """A StepGraph run by torch over a TorchKVCache: a module with the step contract of
    export/model.py (target or vanilla draft) or export/drafters.py (an MTP / Eagle / Eagle3
    step, which takes `hidden_states`).

    cuda_graphs: capture one CUDA graph per bucket (CUDA only). pad: pad steps to buckets
    even without graphs (default: when graphs are on; tests turn it on for the CPU)."""

    def __init__(self, module: torch.nn.Module, max_positions: int, device: str | torch.device,
                 cuda_graphs: bool = True, pad: bool | None = None):
        from trt_spec.export.drafters import OneLayerDrafter

        self.device = torch.device(device)
        if cuda_graphs and self.device.type != "cuda":
            raise ValueError(f"cuda_graphs needs a CUDA device, not {self.device}")
        self.module = use_in_place_attention(module.to(self.device).eval())
        self.max_positions = max_positions
        self.num_layers = module.config.num_layers
        self.takes_hidden = isinstance(module, OneLayerDrafter)
        # per-token outputs after logits, in the module's return order
        self.outputs = (["next_hidden_states"] if self.takes_hidden
                        else ["hidden_states", "eagle3_features"])
        self.cuda_graphs = cuda_graphs
        self.pad = cuda_graphs if pad is None else pad
        # (bucket, cache address) -> (graph, static inputs, static outputs): a graph is bound
        # to the cache buffers it was captured on, so a new cache never replays an old graph
        self.graphs: dict[tuple[Bucket, int], tuple] = {}
        self.failed: dict[Bucket, str] = {}  # buckets whose capture failed: why
        self.pool = None  # one memory pool for every graph of this module
        self.stats = {"eager": 0, "captured": 0, "replayed": 0, "capture_failed": 0,
                      "bucketed": 0}  # steps padded to a bucket

    # --- one forward ------------------------------------------------------------------------

    def _forward(self, inputs: dict[str, torch.Tensor], views: list[torch.Tensor]):
        """-> (logits [B, Nb, V], *per-token outputs [B, Tb, D]) as device tensors."""
        args = [inputs[n] for n in STEP_INPUTS]
        if self.takes_hidden:
            args.insert(1, inputs[HIDDEN_INPUT])
        out = self.module(*args, *views)
        return out[:1 + len(self.outputs)]

    def device_forward(self, inputs: dict[str, torch.Tensor], views: list[torch.Tensor]):
        """The device loop's runner (runtime/device/loop.py): inputs already on the device,
        views the cache rows of the step's slots -> (logits, *per-token outputs), on the
        device, no copy and no sync (the loop captures its phases whole)."""
        return self._forward(inputs, views)

    def _to_device(self, feeds: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
        dtype = next(self.module.parameters()).dtype  # hidden states in the weights' dtype
        return {n: torch.from_numpy(v).to(self.device, dtype if v.dtype.kind == "f" else None)
                for n, v in feeds.items()}

    def _capture(self, inputs: dict[str, torch.Tensor], views: list[torch.Tensor]) -> tuple:
        """Warm up on a side stream, then capture. Both run the real step: writing the new
        keys/values again is idempotent (rows >= past depend only on the inputs and rows
        < past), so the replay that follows gives this step's result."""
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            self._forward(inputs, views)  # lazy init (cuBLAS handles, workspaces) off-graph
        torch.cuda.current_stream(self.device).wait_stream(side)
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            outputs = self._forward(inputs, views)
        self.stats["captured"] += 1
        return graph, inputs, outputs

    def _run(self, bucket: Bucket | None, feeds: dict[str, np.ndarray],
             views: list[torch.Tensor]):
        if bucket is None or not self.cuda_graphs or bucket in self.failed:
            self.stats["eager"] += 1
            return self._forward(self._to_device(feeds), views)
        key = (bucket, views[0].data_ptr())
        entry = self.graphs.get(key)
        if entry is None:
            inputs = self._to_device(feeds)  # the bucket's static inputs from now on
            try:
                entry = self.graphs[key] = self._capture(inputs, views)
            except Exception as e:  # noqa: BLE001 - any capture error: run this bucket eagerly
                self.failed[bucket] = f"{type(e).__name__}: {e}"
                self.stats["capture_failed"] += 1
                warnings.warn(f"CUDA graph capture failed for {bucket}, running it eagerly: "
                              f"{self.failed[bucket]}", RuntimeWarning, stacklevel=3)
                torch.cuda.synchronize(self.device)
                self.stats["eager"] += 1
                return self._forward(inputs, views)
        else:
            for name, static in entry[1].items():
                static.copy_(torch.from_numpy(feeds[name]), non_blocking=False)
        entry[0].replay()
        self.stats["replayed"] += 1
        return entry[2]

    # --- the step contract ------------------------------------------------------------------

    def run(self, cache: KVCache, step: StepInputs,
            want: tuple[str, ...]) -> tuple[np.ndarray, dict[str, np.ndarray], int]:
        if not isinstance(cache, TorchKVCache):
            raise ValueError("the torch-cuda backend needs a TorchKVCache")
        batch, new_tokens = step.feeds["input_ids"].shape
        num_logits = step.feeds["logits_index"].shape[1]
        bucket = (plan_bucket(step.lo, step.hi, new_tokens, num_logits, cache.slots,
                              self.takes_hidden) if self.pad else None)
        if bucket is None:
            rows_of = exact_bucket(step.lo, step.hi, new_tokens, num_logits, self.takes_hidden)
            feeds = step.feeds
        else:
            rows_of = bucket
            self.stats["bucketed"] += 1
            feeds = pad_feeds(step.feeds, cache.lengths, step.lo, bucket)
        with torch.no_grad():
            outs = self._run(bucket, feeds, cache.views(rows_of.lo, rows_of.hi))
            logits = outs[0].float().cpu().numpy()  # (B, Nb, V)
            rows = {name: outs[1 + self.outputs.index(name)].float().cpu().numpy()
                    for name in want}  # (B, Tb, D)
        return logits, rows, rows_of.lo


class TorchFunction:
    """A module without a cache (Eagle3's fc), with OrtFunction's call contract:
    arrays in -> its first output as a NumPy array."""

    def __init__(self, module: torch.nn.Module, device: str | torch.device):
        self.device = torch.device(device)
        self.module = module.to(self.device).eval()

    def __call__(self, *arrays: np.ndarray) -> np.ndarray:
        with torch.no_grad():
            dtype = next(self.module.parameters()).dtype
            out = self.module(*(torch.from_numpy(np.ascontiguousarray(a)).to(self.device, dtype)
                                for a in arrays))
        return (out[0] if isinstance(out, tuple) else out).float().cpu().numpy()


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


class TorchGraphs(GraphSet, DeviceGraphs):
    """The torch modules of an engine, by the graph names the manifest uses (runtime/methods.py
    names them): what Generator asks a backend for."""

    backend = "torch-cuda"

    def __init__(self, manifest: Manifest | None, modules: dict[str, torch.nn.Module],
                 maps: dict[str, np.ndarray], device: str | None = None,
                 cuda_graphs: bool = True, pad: bool | None = None, dtype: str = "float32"):
        """maps: the drafters' draft vocabularies (d2t [draft_vocab] int64) by the file name a
        manifest entry's "d2t" gives ("eagle3_d2t.npy", ...). dtype: the weights' and caches'
        ("float16" / "bfloat16": half the bytes a token reads; logits are compared in fp32)."""
        super().__init__(manifest)
        self.dtype = getattr(torch, dtype)
        if self.dtype != torch.float32:
            modules = {name: m.to(self.dtype) for name, m in modules.items()}
        self.modules = modules
        self._maps = maps
        self.device = torch.device(device or default_device())
        self.cuda_graphs = cuda_graphs and self.device.type == "cuda"
        self.pad = pad
        self.loaded: dict[str, TorchTarget] = {}

    @staticmethod
    def _modules(target, draft, drafters, draft_d2t=None) -> tuple[dict, dict]:
        """-> (modules by graph name, d2t maps by file name); draft_d2t: the vanilla draft's
        (restrict_heads)."""
        modules = {"target": target}
        maps = {}
        if draft is not None:
            vanilla = METHODS["vanilla"]
            modules[vanilla.graphs()[0]] = draft
            if draft_d2t is not None:
                maps[vanilla.d2t_file()] = draft_d2t.numpy().astype(np.int64)
        for kind, d in drafters.items():
            m = METHODS[kind]
            modules.update(zip(m.graphs(len(d.modules)), d.modules))
            if m.fc_graph:
                modules[m.fc_graph] = d.fc
            if d.d2t is not None:
                maps[m.d2t_file()] = d.d2t.numpy().astype(np.int64)
        return modules, maps

    @classmethod
    def from_manifest(cls, manifest: Manifest, device: str | None = None,
                      cuda_graphs: bool = True, pad: bool | None = None,
                      dtype: str = "float32") -> "TorchGraphs":
        """Loads the modules from the folder's source checkpoint (manifest "source")."""
        from trt_spec.export.config import ExportConfig
        from trt_spec.export.pipeline import load_models, restrict_heads
        from trt_spec.runtime.manifest import source_path

        source = manifest.data.get("source")
        if not source or "model" not in source:
            raise EngineFolderError(f"{manifest.folder}: the manifest records no source model; "
                                    "the torch-cuda backend loads the weights from it")
        heads = {k: source_path(manifest, v) for k, v in (source.get("heads") or {}).items()}
        _, target, draft, _, drafters, _ = load_models(ExportConfig(
            source_path(manifest, source["model"]),
            drafters={"vanilla": source_path(manifest, source.get("draft_model")), **heads},
            draft_layers=source.get("draft_layers", 0), shipped_drafters=False))
        if target.config.to_dict() != manifest.config.to_dict():
            raise EngineFolderError(f"{manifest.folder}: its source model {source['model']!r} "
                                    "no longer matches the exported config; re-export")
        # the heads as exported: over the folder's draft vocabulary (older folders: full)
        d2t = restrict_heads(source.get("draft_vocab", "none"), draft, drafters)
        return cls(manifest, *cls._modules(target, draft, drafters, d2t), device, cuda_graphs,
                   pad, dtype)

    @classmethod
    def from_model(cls, model: str, heads: dict[str, str] | None = None, draft_layers: int = 0,
                   draft_model: str | None = None, device: str | None = None,
                   cuda_graphs: bool = True, pad: bool | None = None, dtype: str = "float32"
                   ) -> tuple["TorchGraphs", Manifest]:
        """Straight from a model (name, .gguf or HF folder) and drafter folders: the graphs
        and an in-memory Manifest (folder: the HF folder, for the tokenizer) listing them."""
        from trt_spec.export.config import ExportConfig
        from trt_spec.export.pipeline import load_models

        heads = {k: str(v) for k, v in (heads or {}).items() if v}
        hf_dir, target, draft, kind, drafters, _ = load_models(ExportConfig(
            model, drafters={"vanilla": draft_model, **heads}, draft_layers=draft_layers,
            shipped_drafters=False))
        entries = {}
        if draft is not None:
            entries["vanilla"] = DrafterEntry("vanilla", tuple(METHODS["vanilla"].graphs()),
                                              draft.config, description=kind).to_dict()
        for k, d in drafters.items():
            m = METHODS[k]
            entry = DrafterEntry(k, tuple(m.graphs(len(d.modules))), d.config, source=heads[k])
            if m.fc_graph:
                entry = dataclasses.replace(entry, d2t=m.d2t_file(), draft_vocab_size=len(d.d2t),
                                            fc_graph=m.fc_graph,
                                            feature_layers=tuple(d.feature_layers))
            entries[k] = entry.to_dict()
        modules, maps = cls._modules(target, draft, drafters)
        names = {n: {"backend": cls.backend, "files": []} for n in modules}
        data = {"model_config": target.config.to_dict(), "graphs": names, "drafters": entries,
                "source": {"model": model, "draft_layers": draft_layers,
                           "draft_model": draft_model, "heads": heads}}
        manifest = Manifest(Path(hf_dir), data, target.config)
        return cls(manifest, modules, maps, device, cuda_graphs, pad, dtype), manifest

    # --- the GraphSet contract --------------------------------------------------------------

    def step_graph(self, name: str, config: ModelConfig) -> TorchTarget:
        if name not in self.modules:
            raise EngineFolderError(f"no module {name!r}; loaded: {sorted(self.modules)}")
        if name not in self.loaded:
            self.loaded[name] = TorchTarget(self.modules[name], config.max_position_embeddings,
                                            self.device, self.cuda_graphs, self.pad)
        return self.loaded[name]

    def function(self, name: str) -> TorchFunction:
        return TorchFunction(self.modules[name], self.device)

    def device_function(self, name: str) -> torch.nn.Module:
        """A graph without a cache as a module on the device (tensors in, tensor out)."""
        return self.function(name).module

    def d2t(self, file: str) -> np.ndarray:
        assert file in self._maps, (file, sorted(self._maps))
        return self._maps[file]

    def cache(self, config: ModelConfig, slots: int, max_len: int) -> TorchKVCache:
        return TorchKVCache(config, slots, max_len, self.device, dtype=self.dtype)

    def stats(self) -> dict[str, dict]:
        return {name: dict(t.stats, failed=dict((str(b), why) for b, why in t.failed.items()))
                for name, t in self.loaded.items()}


def graph_source(manifest: Manifest, config) -> TorchGraphs:
    """The torch-cuda graph source (runtime/backends/sources.py): the folder's
    source model on config.device, with CUDA graphs and weights in config.dtype."""
    return TorchGraphs.from_manifest(manifest, config.device, config.cuda_graphs,
                                     dtype=config.dtype)
