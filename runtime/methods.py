"""The speculative methods, each defined once: its name, its graphs and manifest entry, how its
proposer is built, and what export and training call it.

    METHODS["eagle3"].graphs(1)          -> ["eagle3"]      (the drafter step graphs)
    METHODS["eagle3"].fc_graph           -> "eagle3_fc"
    METHODS["vanilla"].train_name        -> "draft"         (`trt-spec train --method draft`)
    DrafterEntry.from_dict("mtp", d)     -> the typed, validated manifest entry
    METHODS["mtp"].proposer(loader, e)   -> an MtpProposer over the loaded graphs

Adding a method: one Method here, plus its proposer in runtime/proposers/ (and, where it runs
on the device executor, its device face in runtime/device/: the Method's `device`). Export
(export/pipeline.py), the torch-cuda backend and the trainer read the graph names from here;
a drafter's checkpoint readers (export/drafter_checkpoint.py) and its trainer
(train/recipes.py) are tables keyed by method, checked against this registry at import.
This module imports no proposer at import time (export reads it without the runtime core).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Protocol

from trt_spec.runtime.config import ModelConfig

if TYPE_CHECKING:
    from trt_spec.runtime.backends.base import Function, StepGraph
    from trt_spec.runtime.device.drafters import DeviceDrafter
    from trt_spec.runtime.kv_cache import KVCache
    from trt_spec.runtime.proposers.base import DraftVocab, Proposer
    from trt_spec.runtime.settings import SpeculationConfig


class DrafterLoader(Protocol):
    """What a method's proposer factory gets from the Generator: the engine's graphs and caches
    sized like the target's."""

    speculation: "SpeculationConfig"
    drafters: dict  # method -> DrafterEntry: the drafters the engine folder has

    def proposer(self, method: str) -> "Proposer | None": ...

    def suffix_cache(self): ...

    def corpus(self): ...

    def step_graph(self, name: str, config: ModelConfig) -> "StepGraph": ...

    def function(self, name: str) -> "Function": ...

    def cache_for(self, config: ModelConfig) -> "KVCache": ...

    def vocab(self, entry: "DrafterEntry") -> "DraftVocab | None": ...


@dataclass(frozen=True)
class Speculation:
    """What a request speculates with, one value from the edge on (LLM's and generate_ids'
    method= and num_draft_tokens=, the server's `speculative` field): a method's name and its
    k (an int, or "auto" / "auto:K": adaptive, at most K). None for either: the engine's
    configured one. Generator.resolve checks it (ValueError quoting the bad value)."""

    method: str | None = None
    k: int | str | None = None


DEFAULT = Speculation()  # the engine's configured method and k


@dataclass(frozen=True)
class DrafterEntry:
    """A manifest `drafters.<method>` entry, typed. Two layouts are on disk: the vanilla draft
    ({"graph", "kind", "model_config"}) and the heads ({"graphs", "num_modules", "source",
    "layer_config"}); both may carry a draft vocabulary ({"d2t", "draft_vocab_size"})."""

    method: str
    graphs: tuple[str, ...]  # step graphs, in drafting order
    config: ModelConfig  # the model each step graph runs (the draft, or one drafter layer)
    description: str = ""  # vanilla: what the draft is
    source: str | None = None  # heads: the checkpoint it was exported from (provenance)
    d2t: str | None = None  # file of the draft vocabulary map, None: the target's vocabulary
    draft_vocab_size: int | None = None
    fc_graph: str | None = None  # Eagle3's feature fusion
    feature_layers: tuple[int, ...] = ()  # Eagle3's target layers
    files: tuple[str, ...] = ()  # extra files (the d2t map)

    @classmethod
    def from_dict(cls, method: str, d: dict) -> "DrafterEntry":
        """Validates `d` (ValueError naming the field) and types it."""
        m = METHODS.get(method)
        if m is None or m.drafter_entry is None:
            known = ", ".join(n for n, x in METHODS.items() if x.drafter_entry)
            raise ValueError(f"drafters.{method}: no method {method!r} with a drafter; "
                             f"known: {known}")
        if not isinstance(d, dict):
            raise ValueError(f"drafters.{method}: expected an object, got {type(d).__name__}")
        graphs_key, config_key = m.drafter_entry
        try:
            graphs = d[graphs_key]
            config = ModelConfig.from_dict(d[config_key])
        except KeyError as e:
            raise ValueError(f"drafters.{method}: field {e} is missing") from None
        graphs = (graphs,) if isinstance(graphs, str) else tuple(graphs)
        if not graphs or not all(isinstance(g, str) for g in graphs):
            raise ValueError(f"drafters.{method}.{graphs_key}: expected graph names, "
                             f"got {graphs!r}")
        if "num_modules" in d and d["num_modules"] != len(graphs):
            raise ValueError(f"drafters.{method}: num_modules {d['num_modules']} but "
                             f"{len(graphs)} graphs")
        return cls(method, graphs, config, d.get("kind", ""), d.get("source"), d.get("d2t"),
                   d.get("draft_vocab_size"), d.get("fc_graph"),
                   tuple(d.get("feature_layers", ())), tuple(d.get("files", ())))

    def to_dict(self) -> dict:
        """The on-disk layout (the one from_dict reads)."""
        graphs_key, config_key = METHODS[self.method].drafter_entry
        d = {graphs_key: self.graphs[0] if graphs_key == "graph" else list(self.graphs),
             config_key: self.config.to_dict()}
        if graphs_key == "graph":
            d["kind"] = self.description
        else:
            d.update(num_modules=len(self.graphs), source=self.source)
        if self.d2t is not None:
            d.update(d2t=self.d2t, files=list(self.files or (self.d2t,)),
                     draft_vocab_size=self.draft_vocab_size)
        if self.fc_graph is not None:
            d.update(fc_graph=self.fc_graph, feature_layers=list(self.feature_layers))
        return d

    @property
    def all_graphs(self) -> list[str]:
        return list(self.graphs) + ([self.fc_graph] if self.fc_graph else [])


@dataclass(frozen=True)
class Method:
    name: str
    summary: str  # one line: what drafts
    # (graphs field, config field) of its manifest entry; None: no drafter graphs
    drafter_entry: tuple[str, str] | None = None
    train_name: str | None = None  # `trt-spec train --method` spelling; None: not trained
    export_hint: str = ""  # the export option that adds its drafter
    fc_graph: str | None = None
    graph_prefix: str | None = None  # step graph names: "{prefix}_{i}" per module; else name
    uses_any: tuple[str, ...] = ()  # runs where the folder has one of these drafters
    picks: tuple[str, ...] = ()  # uses the first of these the folder has, where it has one
    # Traits: what the engine and the device loop read instead of the name.
    lookup: bool = False  # drafts by lookup, without a confidence: `auto` cuts by position
    picks_length: bool = False  # picks its own draft length each step: the gain rules keep k
    reads_corpus: bool = False  # its suffix lookup drafts from the folder's corpus table
    reads: str | None = None  # the target's per-token output its drafter reads (a head's)
    # Traits export and training read: how the drafter is made.
    looped: bool = False  # its head is one module, run at every draft step (Eagle; MTP: one each)
    # its drafter drafts over a reduced vocabulary of its own (a d2t map), which export's
    # --draft-vocab METHOD gives the other drafters too
    own_vocab: bool = False
    # (loader, entry or None) -> Proposer; imports its proposer when called
    make: Callable[["DrafterLoader", "DrafterEntry | None"], "Proposer"] | None = field(
        default=None, compare=False)
    # its device face: (loop, gen, name) -> what drafts it on the device executor's loop
    # (runtime/device/drafters.py; None: nothing, plain decoding); imports torch when called.
    # None: the method runs on the host executor only
    device: Callable[..., "DeviceDrafter | None"] | None = field(default=None, compare=False)

    @property
    def host_drafts(self) -> bool:  # its proposer drafts for the device loop too (uploaded)
        return self.device is _host_drafts

    @property
    def speculative(self) -> bool:
        return self.name != PLAIN

    @property
    def needs_drafter(self) -> bool:
        return self.drafter_entry is not None

    def graphs(self, num_modules: int = 1) -> list[str]:
        """The step graph names of its drafter, as export writes them."""
        if self.name == "vanilla":
            return ["draft"]
        if self.graph_prefix:
            return [f"{self.graph_prefix}_{i}" for i in range(num_modules)]
        return [self.name]

    def d2t_file(self) -> str:
        """The file of its draft vocabulary map, when it has one."""
        return f"{self.name}_d2t.npy"

    def proposer(self, loader: "DrafterLoader", entry: "DrafterEntry | None") -> "Proposer":
        assert self.make is not None, self.name
        return self.make(loader, entry)


# --- proposer factories (lazy imports: export reads this module without the runtime core) -----

def _ngram(loader, entry):
    from trt_spec.runtime.proposers.ngram import NgramProposer

    c = loader.speculation
    return NgramProposer(c.ngram_min, c.ngram_max)


def _suffix(loader, entry):
    from trt_spec.runtime.proposers.suffix import SuffixProposer

    c = loader.speculation
    return SuffixProposer(c.ngram_min, c.ngram_max, loader.suffix_cache, loader.corpus,
                          measured=lambda: loader.speculation.fallback)


def _hybrid(loader, entry):
    from trt_spec.runtime.proposers.hybrid import HybridProposer

    head = next(m for m in METHODS["hybrid"].uses_any if m in loader.drafters)
    return HybridProposer(_suffix(loader, None), loader.proposer(head),
                          measured=lambda: loader.speculation.fallback)


def _auto(loader, entry):
    from trt_spec.runtime.proposers.auto import AutoProposer

    head = next((m for m in METHODS["auto"].picks if m in loader.drafters), None)
    return AutoProposer(_suffix(loader, None), None if head is None else loader.proposer(head),
                        lambda: loader.speculation.fallback)


def _vanilla(loader, entry):
    from trt_spec.runtime.proposers.vanilla import VanillaProposer

    draft = loader.step_graph(entry.graphs[0], entry.config)
    return VanillaProposer(draft, loader.cache_for(entry.config), loader.vocab(entry))


def _heads(loader, entry):
    return [loader.step_graph(g, entry.config) for g in entry.graphs]


def _mtp(loader, entry):
    from trt_spec.runtime.proposers.mtp import MtpProposer

    modules = _heads(loader, entry)
    return MtpProposer(modules, [loader.cache_for(entry.config) for _ in modules],
                       loader.vocab(entry))


def _eagle(loader, entry):
    from trt_spec.runtime.proposers.eagle import EagleProposer

    return EagleProposer(_heads(loader, entry)[0], loader.cache_for(entry.config),
                         loader.vocab(entry))


def _eagle3(loader, entry):
    from trt_spec.runtime.proposers.eagle3 import Eagle3Proposer

    vocab = loader.vocab(entry)
    if vocab is None or entry.fc_graph is None:
        raise ValueError("the eagle3 drafter's manifest entry names no d2t map or fc graph")
    return Eagle3Proposer(_heads(loader, entry)[0], loader.cache_for(entry.config),
                          loader.function(entry.fc_graph), vocab)


# --- device faces (lazy imports: torch where a device loop is made; runtime/device/drafters.py
# imports nothing of the runtime, so no import cycle runs through this registry) -------------

def _plain(loop, gen, name):
    return None  # the loop's step drafts nothing


def _lookup(loop, gen, name):
    from trt_spec.runtime.device.drafters import NgramDrafts

    return NgramDrafts(loop, gen.speculation)


def _draft_model(loop, gen, name):
    from trt_spec.runtime.device.drafters import VanillaDrafts

    return VanillaDrafts(loop, gen, name)


def _head(loop, gen, name):
    from trt_spec.runtime.device.drafters import HeadDrafts

    return HeadDrafts(loop, gen, name, METHODS[name].reads)


def _host_drafts(loop, gen, name):
    from trt_spec.runtime.device.drafters import UploadedDrafts

    head = getattr(gen.proposer(name), "head", None)  # hybrid's, auto's model drafter
    return UploadedDrafts(loop, None if head is None else
                          METHODS[head.name].device(loop, gen, head.name))


PLAIN = "none"  # the method that drafts nothing: plain decoding

METHODS: dict[str, Method] = {m.name: m for m in (
    Method(PLAIN, "nothing: plain decoding, one target forward per token", device=_plain),
    Method("vanilla", "a small draft model (the target's first layers, or a trained one)",
           ("graph", "model_config"), "draft", "--draft-layers N or --draft-model PATH",
           device=_draft_model, make=_vanilla),
    Method("ngram", "prompt lookup: continues the latest earlier match of the last n tokens",
           lookup=True, device=_lookup, make=_ngram),
    Method("suffix", "ngram over the request's tokens, then over earlier requests' (a bounded "
           "cache)", lookup=True, picks_length=True, reads_corpus=True, device=_host_drafts,
           make=_suffix),
    Method("mtp", "N cascaded one-layer modules over the target's hidden state",
           ("graphs", "layer_config"), "mtp", "--mtp CHECKPOINT", graph_prefix="mtp",
           device=_head, reads="hidden_states", make=_mtp),
    Method("eagle", "one MTP-style module, looped",
           ("graphs", "layer_config"), "eagle", "--eagle CHECKPOINT", device=_head,
           reads="hidden_states", looped=True, make=_eagle),
    Method("eagle3", "one 2H-input layer over fused low/mid/high target features, a reduced "
           "draft vocabulary", ("graphs", "layer_config"), "eagle3", "--eagle3 CHECKPOINT",
           fc_graph="eagle3_fc", device=_head, reads="eagle3_features", own_vocab=True,
           make=_eagle3),
    # the heads by measured acceptance on the shipped SmolLM2 drafters (best first)
    Method("hybrid", "suffix lookup where the context repeats, else a model drafter (the "
           "first of mtp, eagle3, eagle, vanilla the folder has)",
           uses_any=("mtp", "eagle3", "eagle", "vanilla"), picks_length=True,
           reads_corpus=True, device=_host_drafts, make=_hybrid),
    Method("auto", "per stream and step, what is measured to pay most here: the suffix "
           "lookup, the folder's model drafter (as hybrid's), or no drafting",
           picks=("mtp", "eagle3", "eagle", "vanilla"), picks_length=True,
           reads_corpus=True, device=_host_drafts, make=_auto),
)}
METHOD_NAMES = tuple(METHODS)
HEAD_METHODS = tuple(n for n, m in METHODS.items() if m.drafter_entry == ("graphs", "layer_config"))


def method(name) -> Method:
    """The method called `name`, or ValueError quoting it and listing the known ones."""
    if not isinstance(name, str) or name not in METHODS:
        raise ValueError(f"method {name!r} is not known; known: {', '.join(METHODS)}")
    return METHODS[name]


def traits(name: str) -> Method:
    """What the engine reads of a method (lookup, picks_length, ...): its registry entry, or
    none of the traits for a proposer the registry lacks (one plugged into the engine
    directly)."""
    return METHODS.get(name) or Method(name, "")


def by_train_name(name: str) -> Method:
    """The method `trt-spec train --method NAME` trains ("draft" is vanilla's drafter)."""
    for m in METHODS.values():
        if m.train_name == name:
            return m
    raise ValueError(f"no method trains as {name!r}; known: "
                     f"{', '.join(m.train_name for m in METHODS.values() if m.train_name)}")


def drafter_graph_names(name: str, num_modules: int = 1) -> list[str]:
    """Every graph a method's drafter exports: its step graphs, then its fc graph if any."""
    m = METHODS[name]
    return m.graphs(num_modules) + ([m.fc_graph] if m.fc_graph else [])


# Training order (`trt-spec train --method all`): the most useful drafter first.
TRAIN_ORDER = ("eagle3", "mtp", "eagle", "vanilla")
TRAIN_NAMES = tuple(METHODS[m].train_name for m in TRAIN_ORDER)  # ("eagle3", ..., "draft")
