"""The target as users run it, for training data: an engine folder's ONNX Runtime graphs
(the int4 serving engine) in place of the torch model.

    EngineGenerator  train/batch_generate.py's continuously refilled loop over the engine's
                     target graph: prefill, a conversation's next turn and the batched decode
                     step run as ONNX Runtime steps over a host KV cache (its slots are the
                     generator's), with the graph's integer kernels on int4. Same `run`, same
                     jobs and answers, so distill_data.py's shards come from either.
    EngineFeatures   what a head trains on (hidden states, Eagle3 features, the target's top-k
                     next-token probabilities), from the engine's own outputs over each whole
                     sequence: the features a head reads when it drafts for that engine.

Both run the target graph with fast decoding (exact_decode off: a training text needs no
bitwise agreement between decoding alone and verifying). Torch only holds the results (the
trainers read torch tensors); it does not run the target.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import torch

from trt_spec.runtime.backends.ort import OrtGraphs, OrtTarget
from trt_spec.runtime.kv_cache import KVCache
from trt_spec.runtime.manifest import Manifest, load_manifest
from trt_spec.runtime.step_inputs import SlotTokens
from trt_spec.train.batch_generate import BatchedGenerator
from trt_spec.train.data import Example
from trt_spec.train.live import LiveFeatures, plan
from trt_spec.train.loop import Batch


class EngineTarget:
    """An engine folder's target graph on ONNX Runtime."""

    def __init__(self, folder: str | Path, threads: int | None = None):
        self.folder = Path(folder)
        if not (self.folder / "manifest.json").is_file():
            raise FileNotFoundError(f"engine folder {str(folder)!r} has no manifest.json "
                                    "(make it with `trt-spec export`)")
        self.manifest: Manifest = load_manifest(self.folder, verify="size")
        self.config = self.manifest.config
        graphs = OrtGraphs(self.manifest, threads, exact_decode=False)
        self.graph: OrtTarget = graphs.step_graph("target", self.config)
        missing = [o for o in ("hidden_states", "eagle3_features") if o not in self.graph.outputs]
        self.feature_outputs = () if missing else ("hidden_states", "eagle3_features")

    @property
    def identity(self) -> str:
        """What its outputs depend on: the manifest's model config and graph files."""
        files = self.manifest.data["files"]
        h = hashlib.sha256(repr(sorted((k, v.get("bytes"), v.get("sha256"))
                                       for k, v in files.items())).encode())
        return f"engine {h.hexdigest()[:16]}"

    def check_model(self, target_config) -> None:
        """Refuses an engine of another model than the one trained for."""
        c = self.config
        for name in ("vocab_size", "hidden_size", "num_layers"):
            if getattr(c, name) != getattr(target_config, name):
                raise ValueError(f"--engine {str(self.folder)!r}: its model has {name} "
                                 f"{getattr(c, name)}, the target trained for has "
                                 f"{getattr(target_config, name)} (an engine of another model)")

    def cache(self, slots: int, max_len: int) -> KVCache:
        if max_len > self.config.max_position_embeddings:
            raise ValueError(f"max_len {max_len}: the engine's model has "
                             f"{self.config.max_position_embeddings} positions")
        return KVCache(self.config, slots, max_len)


class EngineGenerator(BatchedGenerator):
    """BatchedGenerator's loop (`run`) over an engine's target graph; see the module docstring.
    Slot i of the generator is slot i of the engine's KV cache."""

    def __init__(self, engine: EngineTarget, slots: int = 64, max_len: int = 1024, seed: int = 0):
        if slots < 1:
            raise ValueError(f"slots {slots}: must be >= 1")
        if max_len < 2:
            raise ValueError(f"max_len {max_len}: must be >= 2")
        self.engine, self.config = engine, engine.config
        self.slots, self.max_len, self.device, self.dtype = slots, max_len, "cpu", torch.float32
        self.cache = engine.cache(slots, max_len)
        self.generator = torch.Generator().manual_seed(seed)

    def _step(self, requests: list[SlotTokens]) -> list[np.ndarray]:
        return self.engine.graph.step(self.cache, requests).logits

    def prefill(self, slots: list[int], prompts: list[list[int]]) -> torch.Tensor:
        for s in slots:
            self.cache.lengths[s] = 0
        logits = self._step([SlotTokens(s, list(p), [len(p) - 1]) for s, p in zip(slots, prompts)])
        return torch.from_numpy(np.concatenate(logits))

    def extend(self, slot: int, tokens: list[int], offset: int) -> torch.Tensor:
        self.cache.lengths[slot] = offset
        logits = self._step([SlotTokens(slot, list(tokens), [len(tokens) - 1])])
        return torch.from_numpy(logits[0][0])

    def decode(self, tokens: torch.Tensor, positions: torch.Tensor,
               span: int | None = None) -> torch.Tensor:
        n = tokens.shape[0]
        self.cache.lengths[:n] = positions.numpy()
        ids = tokens.tolist()
        logits = self._step([SlotTokens(i, [ids[i]], [0]) for i in range(n)])
        return torch.from_numpy(np.concatenate(logits))

    def _move(self, src: int, dst: int) -> None:
        n = int(self.cache.lengths[src])
        self.cache.copy_rows(src, dst, n)
        self.cache.lengths[dst] = n


class EngineFeatures(LiveFeatures):
    """LiveFeatures (what the trainers read) computed by an engine's target graph: each
    sequence prefilled whole, its per-token hidden states and Eagle3 features, and the top-k
    of the softmax of its logits at every position. Rounded through fp16 like cached
    features."""

    def __init__(self, engine: EngineTarget, examples: list[Example], top_k: int,
                 feature_layers: tuple[int, ...]):
        if not examples:
            raise ValueError("no examples to train on")
        if not engine.feature_outputs:
            raise ValueError(f"{engine.folder}: its target graph has no hidden_states / "
                             "eagle3_features outputs (export it again with this version)")
        self.engine, self.examples, self.top_k = engine, examples, top_k
        self.device = "cpu"
        self.layers = tuple(feature_layers)
        longest = max(len(ex.input_ids) for ex in examples)
        self.cache = engine.cache(1, max(2, longest))
        self.manifest = {"plan": plan(f"engine {engine.identity} {top_k}", examples)}
        self.shards: list[str] = []

    @property
    def feature_layers(self) -> tuple[int, ...]:
        return self.layers

    def rows(self, input_ids: np.ndarray) -> tuple[torch.Tensor, ...]:
        """One sequence -> hidden [T, H], eagle3 [T, 3H], top-k ids [T, k], probs [T, k]."""
        n = len(input_ids)
        if n > self.cache.max_len:
            self.cache = self.engine.cache(1, n)
        self.cache.lengths[0] = 0
        out = self.engine.graph.step(self.cache, [SlotTokens(0, input_ids.tolist(),
                                                             list(range(n)))],
                                     self.engine.feature_outputs)
        logits = torch.from_numpy(out.logits[0])
        probs, ids = logits.softmax(-1).topk(self.top_k, dim=-1)
        return (torch.from_numpy(out.rows["hidden_states"][0]),
                torch.from_numpy(out.rows["eagle3_features"][0]), ids, probs)

    @torch.no_grad()
    def batch(self, indices: list[int], device=None) -> Batch:
        exs = [self.examples[i] for i in indices]
        t = max(len(ex.input_ids) for ex in exs)
        c = self.engine.config
        b = len(exs)
        ids = torch.zeros((b, t), dtype=torch.long)
        mask = torch.zeros((b, t), dtype=torch.bool)
        hidden = torch.zeros((b, t, c.hidden_size))
        eagle3 = torch.zeros((b, t, 3 * c.hidden_size))
        top_ids = torch.zeros((b, t, self.top_k), dtype=torch.long)
        top_probs = torch.zeros((b, t, self.top_k))
        for i, ex in enumerate(exs):
            n = len(ex.input_ids)
            ids[i, :n] = torch.from_numpy(ex.input_ids.astype(np.int64))
            mask[i, :len(ex.loss_mask)] = torch.from_numpy(ex.loss_mask)
            h, e, k_ids, k_probs = self.rows(ex.input_ids)
            hidden[i, :n], eagle3[i, :n], top_ids[i, :n], top_probs[i, :n] = h, e, k_ids, k_probs
        lengths = torch.tensor([len(ex.input_ids) for ex in exs])
        to = device or self.device
        return Batch(ids.to(to), mask.to(to), lengths.to(to), hidden.half().float().to(to),
                     eagle3.half().float().to(to), top_ids.to(to),
                     top_probs.half().float().to(to))
