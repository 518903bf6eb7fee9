"""Load an engine folder and generate: the layer the CLI (and later the Python API) stands on."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from trt_spec.runtime import validation
from trt_spec.runtime.backends.ort import OrtFunction, OrtTarget
from trt_spec.runtime.config import ModelConfig
from trt_spec.runtime.engine import NormalEngine, SpeculativeEngine, StopChecker, Stream
from trt_spec.runtime.kv_cache import KVCache
from trt_spec.runtime.manifest import EngineFolderError, Manifest, load_manifest
from trt_spec.runtime.policy import SpeculationConfig, SpeculationPolicy
from trt_spec.runtime.proposers.base import DraftVocab, Proposer
from trt_spec.runtime.proposers.eagle import EagleProposer
from trt_spec.runtime.proposers.eagle3 import Eagle3Proposer
from trt_spec.runtime.proposers.mtp import MtpProposer
from trt_spec.runtime.proposers.ngram import NgramProposer
from trt_spec.runtime.proposers.vanilla import VanillaProposer
from trt_spec.runtime.sampling import SamplingParams
from trt_spec.runtime.tokenizer import Tokenizer

METHODS = ("none", "vanilla", "ngram", "mtp", "eagle", "eagle3")
BACKENDS = ("ort", "torch-cuda")

Prompt = str | list[dict]  # plain text, or chat messages [{"role", "content"}, ...]


def available_methods(manifest: Manifest) -> list[str]:
    """The methods an engine folder can run: none and ngram always (no graph), a drafter
    method when the manifest lists that drafter (`drafters.<method>`)."""
    drafters = manifest.data.get("drafters", {})
    return [m for m in METHODS if m in ("none", "ngram") or m in drafters]


def check_method(method: str) -> None:
    if method not in METHODS:
        raise ValueError(f"method {method!r} is not available; available: {', '.join(METHODS)}")


def encode_prompt(tokenizer: Tokenizer, prompt: Prompt, chat: bool | None = None) -> list[int]:
    """Chat messages always use the chat template; plain text uses it when chat=True, or
    when chat is None and the tokenizer has one (an instruct model)."""
    if isinstance(prompt, list):
        return tokenizer.encode_chat(validation.chat(prompt))
    if not isinstance(prompt, str):
        raise validation.FieldError("prompt", f"prompt {str(prompt)[:80]!r}: expected a "
                                              "string or a list of chat messages")
    if chat or (chat is None and tokenizer.chat_template):
        return tokenizer.encode_chat([{"role": "user", "content": prompt}])
    return tokenizer.encode(prompt)


@dataclass
class GenerationResult:
    text: str
    token_ids: list[int]
    finish_reason: str
    metrics: dict


class OrtGraphs:
    """The ONNX Runtime graphs of an engine folder, by manifest graph name."""

    backend = "ort"

    def __init__(self, manifest: Manifest, threads: int | None = None, exact_decode: bool = True):
        self.manifest = manifest
        self.threads = threads
        self.exact_decode = exact_decode  # the target's 1-token steps (OrtTarget._padded)

    def step_graph(self, name: str, config: ModelConfig) -> OrtTarget:
        graph = self.manifest.graph(name)
        if graph["backend"] != "ort":
            raise EngineFolderError(f"{self.manifest.folder}: graph {name!r} is for backend "
                                    f"{graph['backend']!r}; this runtime runs 'ort'")
        path = self.manifest.path(graph["files"][0])
        target = OrtTarget(path, config.num_layers, config.max_position_embeddings, self.threads,
                           exact_decode=self.exact_decode and name == "target")
        want = [i["name"] for i in graph["inputs"]]
        got = [i.name for i in target.session.get_inputs()]
        if want != got:
            raise EngineFolderError(f"{path}: graph inputs {got} differ from the manifest's {want}")
        return target

    def function(self, name: str) -> OrtFunction:
        return OrtFunction(self.manifest.path(self.manifest.graph(name)["files"][0]), self.threads)

    def d2t(self, manifest: Manifest, entry: dict) -> np.ndarray:
        return np.load(manifest.path(entry["d2t"]))

    def cache(self, config: ModelConfig, slots: int, max_len: int) -> KVCache:
        return KVCache(config, slots, max_len)


def make_graphs(manifest: Manifest, backend: str, threads: int | None = None,
                device: str | None = None, cuda_graphs: bool = True, exact_decode: bool = True):
    """The graph source of `backend`: "ort" (the folder's ONNX graphs) or "torch-cuda" (the
    export modules, loaded from the folder's source checkpoint; runtime/backends/torch_cuda.py)."""
    if backend == "ort":
        return OrtGraphs(manifest, threads, exact_decode)
    if backend == "torch-cuda":
        try:
            from trt_spec.runtime.backends.torch_cuda import TorchGraphs
        except ImportError as e:
            raise ValueError(f"backend 'torch-cuda' needs torch ({e}); install the export "
                             "extra: pip install -e '.[export]'") from e
        return TorchGraphs.from_manifest(manifest, device, cuda_graphs)
    raise ValueError(f"backend={backend!r}: expected one of {', '.join(BACKENDS)}")


class Generator:
    def __init__(self, engine_dir: str | Path, method: str = "none", max_batch: int = 1,
                 max_len: int = 2048, threads: int | None = None, verify: str = "sha256",
                 speculation: SpeculationConfig | None = None, ngram: tuple[int, int] = (1, 4),
                 tokenizer: Tokenizer | None = None, backend: str = "ort",
                 device: str | None = None, cuda_graphs: bool = True, exact_decode: bool = True):
        """tokenizer: this folder's, when the caller already loaded it (see cli generate).
        backend: "ort", or "torch-cuda" on `device` (default: cuda when available) with
        CUDA graphs unless cuda_graphs=False.
        exact_decode (ort): the target's 1-token steps run as 2-token steps, so plain and
        speculative greedy decoding give the same tokens (OrtTarget._padded); False saves
        c(2)/c(1) per plain decoding step, and outputs can then differ at near-ties."""
        check_method(method)  # before any loading
        if backend not in BACKENDS:
            raise ValueError(f"backend={backend!r}: expected one of {', '.join(BACKENDS)}")
        t0 = time.perf_counter()
        manifest = load_manifest(engine_dir, verify=verify)
        graphs = make_graphs(manifest, backend, threads, device, cuda_graphs, exact_decode)
        self._init(manifest, graphs, method, max_batch, max_len, speculation, ngram, tokenizer, t0)

    @classmethod
    def from_graphs(cls, manifest: Manifest, graphs, method: str = "none", max_batch: int = 1,
                    max_len: int = 2048, speculation: SpeculationConfig | None = None,
                    ngram: tuple[int, int] = (1, 4),
                    tokenizer: Tokenizer | None = None) -> "Generator":
        """Over graphs already loaded (TorchGraphs.from_model: no engine folder)."""
        check_method(method)
        gen = cls.__new__(cls)
        gen._init(manifest, graphs, method, max_batch, max_len, speculation, ngram, tokenizer,
                  time.perf_counter())
        return gen

    def _init(self, manifest, graphs, method, max_batch, max_len, speculation, ngram,
              tokenizer, t0) -> None:
        if max_batch < 1:
            raise ValueError(f"max_batch={max_batch}: must be >= 1")
        self.manifest = manifest
        self.graphs = graphs
        self.backend = graphs.backend
        config = manifest.config
        self.target = graphs.step_graph("target", config)
        self.tokenizer = tokenizer or Tokenizer(self.manifest.folder)
        if self.tokenizer.vocab_size > config.vocab_size:
            raise EngineFolderError(f"{self.manifest.folder / 'tokenizer.json'}: "
                                    f"{self.tokenizer.vocab_size} tokens, the model has "
                                    f"{config.vocab_size}")
        self.config = config
        self.cache = graphs.cache(config, max_batch, min(max_len, config.max_position_embeddings))
        eos = set(config.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            eos.add(self.tokenizer.eos_token_id)
        self.stops = StopChecker(self.tokenizer, eos, self.cache.max_len)
        self._proposers: dict[str, Proposer] = {}  # drafters loaded once, shared by engines
        self.method = method
        self.engine = self.make_engine(method, speculation, ngram)
        self.load_seconds = time.perf_counter() - t0

    def make_engine(self, method: str, speculation: SpeculationConfig | None = None,
                    ngram: tuple[int, int] = (1, 4)) -> NormalEngine:
        """An engine for `method` over this generator's target, cache and tokenizer (engines
        built here share them, so a bench can interleave methods on one loaded model)."""
        check_method(method)
        if method == "none":
            return NormalEngine(self.target, self.cache, self.stops)
        policy = SpeculationPolicy(speculation or SpeculationConfig(), self.cache.max_len)
        proposer = NgramProposer(*ngram) if method == "ngram" else self._proposer(method)
        return SpeculativeEngine(self.target, self.cache, self.stops, proposer, policy)

    def _proposer(self, method: str) -> Proposer:
        """The drafter `method` from the engine folder, loaded once."""
        if method in self._proposers:
            return self._proposers[method]
        drafters = self.manifest.data["drafters"]
        if method not in drafters:
            how = ("--draft-layers N or --draft-model" if method == "vanilla"
                   else f"--{method} CHECKPOINT")
            raise ValueError(f"{self.manifest.folder} has no {method} drafter (export it with "
                             f"{how}); drafters here: {sorted(drafters) or 'none'}")
        entry = drafters[method]
        vocab = self._draft_vocab(method, entry)
        if method == "vanilla":
            config = ModelConfig.from_dict(entry["model_config"])
            draft = self.graphs.step_graph(entry["graph"], config)
            proposer = VanillaProposer(draft, self._cache(config), vocab)
        else:
            config = ModelConfig.from_dict(entry["layer_config"])
            modules = [self.graphs.step_graph(name, config) for name in entry["graphs"]]
            caches = [self._cache(config) for _ in modules]
            if method == "mtp":
                proposer = MtpProposer(modules, caches, vocab)
            elif method == "eagle":
                proposer = EagleProposer(modules[0], caches[0], vocab)
            else:
                if vocab is None:
                    raise EngineFolderError(f"{self.manifest.folder}: the eagle3 drafter's "
                                            "manifest entry names no d2t map")
                proposer = Eagle3Proposer(modules[0], caches[0],
                                          self.graphs.function(entry["fc_graph"]), vocab)
        self._proposers[method] = proposer
        return proposer

    def _draft_vocab(self, method: str, entry: dict) -> DraftVocab | None:
        """The drafter's draft vocabulary (its entry's "d2t" map), or None: its head spans the
        target's vocabulary (every folder exported before --draft-vocab)."""
        if "d2t" not in entry:
            return None
        d2t = self.graphs.d2t(self.manifest, entry)
        if len(d2t) != entry.get("draft_vocab_size", len(d2t)):
            raise EngineFolderError(f"{self.manifest.folder / entry['d2t']}: {len(d2t)} ids, "
                                    f"the {method} entry says {entry['draft_vocab_size']}")
        try:
            return DraftVocab(d2t, self.config.vocab_size)
        except ValueError as e:
            raise EngineFolderError(f"{self.manifest.folder / entry['d2t']}: {e}") from e

    def _cache(self, config: ModelConfig) -> KVCache:
        return self.graphs.cache(config, self.cache.slots, self.cache.max_len)

    def encode(self, prompt: Prompt, chat: bool | None = None) -> list[int]:
        return encode_prompt(self.tokenizer, prompt, chat)

    def generate_ids(self, prompts_ids: list[list[int]], params: SamplingParams,
                     speculate: bool = True) -> list[Stream]:
        """Runs every prompt to completion, at most `cache.slots` at a time."""
        streams = [Stream(ids, params, speculate=speculate) for ids in prompts_ids]
        waiting, running = list(streams), []
        while waiting or running:
            while waiting and len(running) < self.cache.slots:
                s = waiting.pop(0)
                self.engine.admit(s)
                running.append(s)
            self.engine.step(running)
            running = [s for s in running if not s.finished]
        return streams

    def generate(self, prompts: list[Prompt], params: SamplingParams | None = None,
                 chat: bool | None = None, speculate: bool = True) -> list[GenerationResult]:
        params = params or SamplingParams()
        streams = self.generate_ids([self.encode(p, chat) for p in prompts], params, speculate)
        return [GenerationResult(s.text, s.output_ids, s.finish_reason, s.metrics())
                for s in streams]
