"""Load an engine folder: its target, KV cache, tokenizer, drafters and the one Engine that
steps them. The scheduler (runtime/scheduler.py), the Python API and the server use it; it
uses none of them."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path


from trt_spec.runtime import memory, validation
from trt_spec.runtime.backends.base import GraphSet
from trt_spec.runtime.backends.sources import load_graphs
from trt_spec.runtime.speculation.cost_cache import CostCache, cost_key
from trt_spec.runtime.engine import Engine
from trt_spec.runtime.manifest import EngineFolderError, Manifest, load_manifest
from trt_spec.runtime.methods import (DEFAULT, METHODS, PLAIN, DrafterEntry, Speculation,
                                      method as known_method)
from trt_spec.runtime.prefix_cache import PrefixCache
from trt_spec.runtime.proposers.base import DraftVocab, Proposer
from trt_spec.runtime.sampling import SamplingParams
from trt_spec.runtime.settings import RuntimeConfig, parse_num_draft_tokens
from trt_spec.runtime.grammar import Grammars
from trt_spec.runtime.stream import StopChecker, Stream
from trt_spec.runtime.tokenizer import Tokenizer
from trt_spec.runtime.tool_calls import Tool
from trt_spec.runtime.tool_formats import for_template, format_of

Prompt = str | list[dict]  # plain text, or chat messages [{"role", "content"}, ...]


def drafter_entries(manifest: Manifest) -> dict[str, DrafterEntry]:
    """The folder's drafters, typed and validated (EngineFolderError naming the folder)."""
    entries = {}
    for name, d in manifest.data.get("drafters", {}).items():
        try:
            entries[name] = DrafterEntry.from_dict(name, d)
        except ValueError as e:
            raise EngineFolderError(f"{manifest.folder}: {e}") from None
    return entries


def available_methods(manifest: Manifest) -> list[str]:
    """The methods an engine folder can run: those without a drafter always, a drafter
    method when the manifest lists its drafter (`drafters.<method>`)."""
    drafters = manifest.data.get("drafters", {})
    return [m for m, x in METHODS.items()
            if (m in drafters if x.needs_drafter else
                not x.uses_any or any(h in drafters for h in x.uses_any))]


def encode_prompt(tokenizer: Tokenizer, prompt: Prompt, chat: bool | None = None,
                  tools: list[Tool] | None = None,
                  template_kwargs: dict | None = None) -> list[int]:
    """Chat messages always use the chat template; plain text uses it when chat=True, or
    when chat is None and the tokenizer has one (an instruct model). tools: shown to the
    model in its template's format (runtime/tool_calls.py), as are earlier tool turns.
    template_kwargs: more of the template's variables (chat_template_kwargs, checked by
    runtime/reasoning.py's template_kwargs: e.g. {"enable_thinking": False})."""
    extra = template_kwargs or {}
    if isinstance(prompt, list):
        messages, variables = for_template(tokenizer.template_text(tools),
                                           validation.chat(prompt), tools or [])
        return tokenizer.encode_chat(messages, **extra, **variables)
    if not isinstance(prompt, str):
        raise validation.FieldError("prompt", f"prompt {str(prompt)[:80]!r}: expected a "
                                              "string or a list of chat messages")
    if chat or (chat is None and tokenizer.chat_template):
        return tokenizer.encode_chat([{"role": "user", "content": prompt}], **extra)
    return tokenizer.encode(prompt)


class Generator:
    """An engine folder loaded for generation: its target, KV cache, tokenizer, the drafters
    its requests use (loaded once, on first use) and the one Engine that steps them."""

    def __init__(self, engine_dir: str | Path, config: RuntimeConfig | None = None, *,
                 tokenizer: Tokenizer | None = None, **options):
        """config: the runtime settings; or flat `options` (RuntimeConfig.from_options: e.g.
        method="ngram", max_batch=4, num_draft_tokens=2). tokenizer: this folder's, when the
        caller already loaded it."""
        config = self._config(config, options)
        t0 = time.perf_counter()
        manifest = load_manifest(engine_dir, verify=config.verify)
        # what the weights and caches will take, checked before any graph is read: ValueError
        # naming the numbers and the settings that fit (runtime/memory.py)
        self.memory = memory.memory_plan(manifest, config, drafter_entries(manifest))
        self.memory_available = memory.check(self.memory, config.memory_utilization)
        self._init(manifest, load_graphs(manifest, config), config, tokenizer, t0)

    @classmethod
    def from_graphs(cls, manifest: Manifest, graphs: GraphSet,
                    config: RuntimeConfig | None = None, *, tokenizer: Tokenizer | None = None,
                    **options) -> "Generator":
        """Over graphs already loaded (TorchGraphs.from_model: no engine folder). Its memory
        is not checked: the weights are in memory already."""
        gen = cls.__new__(cls)
        gen.memory = gen.memory_available = None
        gen._init(manifest, graphs, cls._config(config, options), tokenizer, time.perf_counter())
        return gen

    @staticmethod
    def _config(config: RuntimeConfig | None, options: dict) -> RuntimeConfig:
        if config is not None and options:
            raise ValueError(f"give a RuntimeConfig or options {sorted(options)}, not both")
        return config or RuntimeConfig.from_options(**options)

    def _init(self, manifest: Manifest, graphs: GraphSet, config: RuntimeConfig,
              tokenizer: Tokenizer | None, t0: float) -> None:
        self.settings = config
        self.manifest = manifest
        self.graphs = graphs
        self.backend = graphs.backend
        self.config = manifest.config  # the target model's
        self.drafters = drafter_entries(manifest)
        self.target = graphs.step_graph("target", self.config)
        self.tokenizer = tokenizer or Tokenizer(manifest.folder)
        if config.chat_template is not None:  # --chat-template: a bad file fails here
            self.tokenizer.use_template_file(config.chat_template)
        # the special tokens the template's tool calls start with stay in the output's text,
        # where the call parser reads them ([TOOL_CALLS], <|python_tag|>: tool_calls.py)
        self.tokenizer.keep_special(format_of(self.tokenizer.template_text(True)).markers)
        self.tokenizer.escape_special = config.escape_special_tokens
        if self.tokenizer.vocab_size > self.config.vocab_size:
            raise EngineFolderError(f"{manifest.folder / 'tokenizer.json'}: "
                                    f"{self.tokenizer.vocab_size} tokens, the model has "
                                    f"{self.config.vocab_size}")
        max_len = min(config.max_len, self.config.max_position_embeddings)
        self.cache = graphs.cache(self.config, config.max_batch, max_len)
        eos = set(self.config.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            eos.add(self.tokenizer.eos_token_id)
        self.stops = StopChecker(self.tokenizer, eos, self.cache.max_len)
        self.speculation = config.speculation
        self._proposers: dict[str, Proposer | None] = {PLAIN: None}
        self._suffix_cache = None
        self._corpus = None
        self._device_executor = None  # made on first use (device_executor)
        self._grammars = None
        self.engine = Engine(self.target, self.cache, self.stops, config.speculation,
                             self.proposer, self._prefix_cache(config),
                             self._cost_cache(config))
        self.method = self.check_method(config.method)
        self.proposer(self.method)  # a broken default drafter fails now
        self.load_seconds = time.perf_counter() - t0

    def _cost_cache(self, config: RuntimeConfig) -> CostCache | None:
        if not config.cost_cache:
            return None
        files = self.manifest.data.get("files", {})
        target = {f: files.get(f, {}) for f in self.manifest.graph("target")["files"]}
        return CostCache.for_key(cost_key(target, self.backend, config.threads,
                                          config.exact_decode))

    def _prefix_cache(self, config: RuntimeConfig) -> PrefixCache | None:
        return PrefixCache(self.cache) if config.prefix_cache else None

    @property
    def prefix_cache(self) -> PrefixCache | None:
        """The prefix cache admission reads (None: off); its `stats` are the totals."""
        return self.engine.prefix

    def configure(self, **options) -> "Generator":
        """Changes the settings that need no reload (method, speculation and its fields,
        max_prefill_tokens, max_waiting, prefix_cache), validated as RuntimeConfig.replace;
        returns self. Turning the prefix cache off drops what it kept."""
        new = self.settings.replace(**options)
        fixed = [f for f in ("backend", "device", "threads", "cuda_graphs", "exact_decode", "dtype",
                             "verify", "max_batch", "max_len", "memory_utilization")
                 if getattr(new, f) != getattr(self.settings, f)]
        if fixed:
            raise ValueError(f"{', '.join(fixed)} cannot change once the engine folder is "
                             "loaded; load a new Generator")
        self.method = self.check_method(new.method)
        self.proposer(self.method)
        self.settings, self.speculation = new, new.speculation
        self.engine.planner.configure(new.speculation)
        if new.prefix_cache != (self.engine.prefix is not None):
            self.cache.forget()
            self.engine.prefix = self._prefix_cache(new)
        return self

    # --- methods and their drafters -------------------------------------------------------

    @property
    def methods(self) -> list[str]:
        return available_methods(self.manifest)

    def check_method(self, method) -> str:
        """method, or ValueError quoting it and listing what this folder can run."""
        known_method(method)
        if method not in self.methods:
            m = METHODS[method]
            how = (f"export it with {m.export_hint}" if m.export_hint else
                   f"it needs one of {', '.join(m.uses_any)}")
            raise ValueError(f"this engine has no {method} drafter ({how}); methods here: "
                             f"{', '.join(self.methods)}")
        return method

    def proposer(self, method: str) -> Proposer | None:
        """The proposer of `method` (None for none), built on first use and kept."""
        if method not in self._proposers:
            entry = self.drafters.get(self.check_method(method))
            self._proposers[method] = METHODS[method].proposer(self, entry)
        return self._proposers[method]

    # the DrafterLoader a method's proposer factory builds from (runtime/methods.py)
    def step_graph(self, name: str, config):
        return self.graphs.step_graph(name, config)

    def function(self, name: str):
        return self.graphs.function(name)

    def cache_for(self, config):
        return self.graphs.cache(config, self.cache.slots, self.cache.max_len)

    def suffix_cache(self):
        """The cache of earlier requests' tokens every suffix lookup of this engine shares."""
        if self._suffix_cache is None:
            from trt_spec.runtime.proposers.suffix import SuffixCache

            self._suffix_cache = SuffixCache()
        return self._suffix_cache

    @property
    def suffix_cache_tokens(self) -> tuple[int, int]:
        """(tokens held, bound) of the suffix lookups' cache; (0, 0) while no lookup made it."""
        c = self._suffix_cache
        return (c.tokens, c.max_tokens) if c is not None else (0, 0)

    def corpus(self):
        """The folder's corpus table (runtime/runtime/corpus.py), loaded once; None where it
        has none or the settings turn it off."""
        entry = self.manifest.data.get("corpus")
        if not entry or not self.speculation.corpus:
            return None
        if self._corpus is None:
            from trt_spec.runtime.corpus import CorpusTable

            try:
                self._corpus = CorpusTable.load(self.manifest.path(entry["file"]))
            except (OSError, ValueError, KeyError) as e:
                raise EngineFolderError(f"{self.manifest.folder}: corpus table: {e}") from e
        return self._corpus

    def use_suffix_cache(self, cache) -> None:
        """From now on the suffix lookups read and fill `cache` (a bench: one per config)."""
        self._suffix_cache = cache

    def vocab(self, entry: DrafterEntry) -> DraftVocab | None:
        """The drafter's draft vocabulary (its entry's d2t map), or None: its head spans the
        target's vocabulary (every folder exported before --draft-vocab)."""
        if entry.d2t is None:
            return None
        d2t = self.graphs.d2t(entry.d2t)
        where = self.manifest.folder / entry.d2t
        if entry.draft_vocab_size is not None and len(d2t) != entry.draft_vocab_size:
            raise EngineFolderError(f"{where}: {len(d2t)} ids, the {entry.method} entry says "
                                    f"{entry.draft_vocab_size}")
        try:
            return DraftVocab(d2t, self.config.vocab_size)
        except ValueError as e:
            raise EngineFolderError(f"{where}: {e}") from e

    # --- generation -----------------------------------------------------------------------

    def encode(self, prompt: Prompt, chat: bool | None = None) -> list[int]:
        return encode_prompt(self.tokenizer, prompt, chat)

    def stream(self, prompt_ids: list[int], params: SamplingParams,
               spec: Speculation = DEFAULT) -> Stream:
        """A Stream for a request, speculating as `spec` asks (DEFAULT: as configured)."""
        method, k, adaptive = self.resolve(spec)
        validation.ids_in_vocabulary(params, self.config.vocab_size)
        params = self.with_model_stops(params)
        return Stream(list(prompt_ids), params, method, k, adaptive=adaptive,
                      guide=self.guide(params))

    def with_model_stops(self, params: SamplingParams) -> SamplingParams:
        """params with this model's end tokens as eos_token_ids, which min_tokens holds back
        (runtime/sampling.py); params itself without min_tokens."""
        if not params.min_tokens or params.eos_token_ids:
            return params
        return dataclasses.replace(params, eos_token_ids=tuple(sorted(self.stops.eos_ids)))

    def guide(self, params: SamplingParams):
        """The request's structure compiled into a guide (runtime/grammar.py), or None when it
        has none. ValueError (a FieldError naming the field) for a structure that cannot be."""
        if params.structure is None:
            return None
        return self.grammars.guide(params, self.speculation.grammar_drafts)

    @property
    def grammars(self) -> Grammars:
        """This engine's structured outputs (runtime/grammar.py), made on first use."""
        if self._grammars is None:
            self._grammars = Grammars(self.tokenizer, self.config.vocab_size,
                                      sorted(self.stops.eos_ids))
        return self._grammars

    def resolve(self, spec: Speculation) -> tuple[str, int, bool]:
        """(method, k, adaptive) for a request; None takes the configured method and k.
        ValueError quoting a bad value."""
        assert isinstance(spec, Speculation), spec  # (method, k) travel as one value
        method = self.check_method(self.method if spec.method is None else spec.method)
        if not METHODS[method].speculative:
            if spec.k is not None:
                raise ValueError(f"num_draft_tokens={spec.k}: method {method!r} "
                                 "drafts nothing; pick a speculative method")
            return method, 0, False
        if spec.k is None:
            return method, self.speculation.num_draft_tokens, self.speculation.adaptive
        return (method, *parse_num_draft_tokens(spec.k))

    @property
    def device_executor(self):
        """The device executor (runtime/device/loop.py), made on first use; None where the
        settings or the backend keep every request on the host (runtime/executors.py)."""
        from trt_spec.runtime import executors

        if not executors.device_wanted(self) or executors.backend_reason(self) is not None:
            return None
        if self._device_executor is None:
            from trt_spec.runtime.device.loop import DeviceExecutor

            self._device_executor = DeviceExecutor(self)
        return self._device_executor
