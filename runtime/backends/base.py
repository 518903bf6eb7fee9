"""The backend contract: what the engine asks of ONNX Runtime, torch-cuda and TensorRT.

A backend supplies a GraphSet (the graphs of an engine folder, by manifest name, and the KV
caches they run over) whose step graphs implement one method, `run`: execute the graph on
inputs already built. Everything else about a step is here, written once:

    StepGraph.step(cache, requests, want):
        requests = prepare(cache, requests)            # a backend may reshape them (ORT: exact
                                                       # decoding for engines without it in-graph)
        inputs   = build_step_inputs(cache, requests,  # runtime/step_inputs.py
                                     min_rows=step_min_rows)
        logits, rows, lo = run(cache, inputs, want)    # the backend: one forward (one per
                                                       # request when the padded step does
                                                       # not fit a slot's rows: fits)
        cache lengths += new tokens
        -> StepOutput: per request, its logits rows and its rows of each wanted output

The graph sources by backend name: runtime/backends/sources.py.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Callable, Protocol, runtime_checkable

import numpy as np

from trt_spec.runtime.config import ModelConfig
from trt_spec.runtime.graph_io import HIDDEN_INPUT
from trt_spec.runtime.kv_cache import KVCache
from trt_spec.runtime.manifest import Manifest
from trt_spec.runtime.step_inputs import (SlotTokens, StepInputs, build_step_inputs,
                                          commit_lengths, fits)



@dataclass
class StepOutput:
    """Per request, in request order."""

    logits: list[np.ndarray]  # [len(logits_at), vocab]
    rows: dict[str, list[np.ndarray]]  # wanted per-token outputs: name -> [len(tokens), D]


class StepGraph(ABC):
    """A graph with the step contract of export/model.py: the target, a vanilla draft, or a
    drafter step (export/drafters.py: one layer, plus a `hidden_states` input).

    Subclasses set max_positions, takes_hidden and outputs (the per-token outputs besides
    logits, in graph order) and implement `run`."""

    max_positions: int
    takes_hidden: bool
    outputs: list[str]
    step_min_rows: int = 1  # build_step_inputs' min_rows (ORT's exact decoding may raise it)

    def prepare(self, cache: KVCache, requests: list[SlotTokens]) -> tuple[list[SlotTokens], int]:
        """-> (the requests to run, cache rows past max_len they may write). Default: as given."""
        return requests, 0

    def decode_one(self, cache: KVCache, slot: int, token: int,
                   rows: dict[str, np.ndarray | None] | None = None) -> np.ndarray | None:
        """Plain decoding's 1-token step for one slot, where a backend has a leaner path than
        `step` (ORT: runtime/backends/ort.py) -> its logits [vocab]; None: run `step`.
        rows: the per-token outputs wanted (name -> None), each set to its row [1, D]."""
        return None

    def decode_rows(self, cache: KVCache, slot: int, tokens: list[int],
                    rows: dict[str, np.ndarray | None] | None = None) -> np.ndarray | None:
        """decode_one for one stream's T tokens, logits at every row -> [T, vocab]; None:
        run `step`."""
        return None

    @abstractmethod
    def run(self, cache: KVCache, step: StepInputs,
            want: tuple[str, ...]) -> tuple[np.ndarray, dict[str, np.ndarray], int]:
        """One forward over `step` -> (logits [B', N', V], {name: [B', T', D]} for each wanted
        output, the cache slot of row 0). B' >= the step's batch, N' / T' >= its sizes (a
        backend may pad to a bucket); the cache rows of the new tokens are written."""

    def step(self, cache: KVCache, requests: list[SlotTokens],
             want: tuple[str, ...] = ()) -> StepOutput:
        """Runs the new tokens of every request in one forward and advances their lengths.
        `want`: per-token outputs to return (e.g. "hidden_states", "eagle3_features")."""
        unknown = [w for w in want if w not in self.outputs]
        if unknown:
            raise ValueError(f"outputs {unknown} are not among this graph's {self.outputs}")
        run, scratch = self.prepare(cache, requests)
        # near the end of the context a slot may lack room for the step's padded columns:
        # then each request alone (it fits by itself: its own tokens are within max_len)
        groups = [run] if fits(cache, run, self.step_min_rows) else [[r] for r in run]
        ran = {}  # slot -> (logits, rows, lo) of the forward it ran in
        for group in groups:
            step = build_step_inputs(cache, group, self.max_positions, scratch,
                                     self.step_min_rows)
            if self.takes_hidden != (HIDDEN_INPUT in step.feeds):
                raise ValueError("a drafter graph needs hidden states with every request; a "
                                 "target graph takes none")
            result = self.run(cache, step, want)
            ran.update((r.slot, result) for r in group)
        commit_lengths(cache, requests)
        out = StepOutput([], {name: [] for name in want})
        for r in requests:
            logits, rows, lo = ran[r.slot]
            out.logits.append(logits[r.slot - lo, :len(r.logits_at)])
            for name in want:
                out.rows[name].append(rows[name][r.slot - lo, :len(r.tokens)])
        return out


Function = Callable[..., np.ndarray]  # a graph without a cache (Eagle3's fc): arrays -> array


class GraphSet(ABC):
    """The graphs of one engine, by the names its manifest uses ("target", "draft", "mtp_0",
    "eagle", "eagle3", "eagle3_fc", ...), and the caches they run over."""

    backend: str

    def __init__(self, manifest: Manifest):
        self.manifest = manifest

    @abstractmethod
    def step_graph(self, name: str, config: ModelConfig) -> StepGraph:
        """A target-style graph; `config`: the model it runs (target, draft or drafter layer)."""

    @abstractmethod
    def function(self, name: str) -> Function:
        """A graph without a cache."""

    @abstractmethod
    def cache(self, config: ModelConfig, slots: int, max_len: int) -> KVCache:
        """A KV cache this backend's graphs run over."""

    def d2t(self, file: str) -> np.ndarray:
        """A draft vocabulary map (d2t [draft_vocab] int64) by its file name in the folder."""
        return np.load(self.manifest.path(file))


@runtime_checkable
class DeviceRunner(Protocol):
    """A StepGraph that also runs on device tensors (the device loop's graph runner,
    runtime/device/loop.py): the torch-cuda backend's modules, or a TensorRT engine."""

    def device_forward(self, inputs: dict, views: list) -> tuple:
        """inputs: the step's feeds as device tensors; views: the cache rows of the step's
        slots, written in place -> (logits, per-token outputs ...) as device tensors."""


@runtime_checkable
class DeviceGraphs(Protocol):
    """A GraphSet whose graphs run on one device, the device loop's: where, in what dtype,
    whether it may capture CUDA graphs, and the cache-free graphs as device modules."""

    device: object  # a torch.device
    dtype: object  # a torch dtype: the weights' and caches'
    cuda_graphs: bool

    def device_function(self, name: str):
        """A graph without a cache (Eagle3's fc) as a callable on device tensors."""
