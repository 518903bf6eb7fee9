"""The runtime's settings, validated once, defaults in one place: what the CLI (`generate`,
`bench`, `serve`), the Python API (`LLM`) and the server build, and the Generator and
Scheduler read.

    RuntimeConfig(method="eagle3", max_batch=8, speculation=SpeculationConfig(num_draft_tokens=2))
    RuntimeConfig.from_options(method="eagle3", num_draft_tokens=2, max_batch=8)   # flat form
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import NamedTuple

from trt_spec.runtime.backends.sources import BACKENDS
from trt_spec.runtime.options import field_options, option, option_names
from trt_spec.runtime.methods import METHOD_NAMES, PLAIN

VERIFY = ("sha256", "size", "none")
DTYPES = ("float32", "float16", "bfloat16")
EXECUTORS = ("auto", "host", "device")  # runtime/executors.py
MAX_DRAFT_TOKENS = 64  # k is 1..MAX_DRAFT_TOKENS
SERVE_MAX_BATCH = 8  # KV slots of `serve` and `LLM` (one-shot `generate`: 1)
# Prompt tokens prefilled per scheduler step. Chosen by `scripts/load.py --long-prompt` on the
# int4 SmolLM2 engine (docs/serving.md): small enough that streams decoding beside a long
# prompt keep their pace, large enough that the prompt's first token is not much later.
DEFAULT_MAX_PREFILL_TOKENS = 16
DEFAULT_MAX_BODY_BYTES = 1 << 20  # `serve`: 1 MiB, far past any prompt a 2,048-token context holds


AUTO_MAX_DRAFT_TOKENS = 6  # `auto`: the most tokens a step drafts (runtime/speculation/draft_length.py)


def check_num_draft_tokens(k) -> int:
    """k, or ValueError quoting it: an integer in 1..MAX_DRAFT_TOKENS."""
    if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= MAX_DRAFT_TOKENS:
        raise ValueError(f"num_draft_tokens={k!r}: must be an integer in 1..{MAX_DRAFT_TOKENS}, "
                         "or auto / auto:K")
    return k


def draft_tokens_label(k: int, adaptive: bool) -> str:
    return f"auto:{k}" if adaptive else str(k)


class DraftTokens(NamedTuple):
    """num_draft_tokens as parsed at the edge (a CLI option, an HTTP field, an API argument),
    and passed on as it is: k, and whether each step picks up to k itself (auto:K)."""

    k: int
    adaptive: bool = False

    def __str__(self) -> str:
        return draft_tokens_label(self.k, self.adaptive)


def parse_num_draft_tokens(value) -> DraftTokens:
    """k (fixed) or "auto" / "auto:K" (adaptive, at most K) -> DraftTokens(k, adaptive); an
    integer string is a fixed k; a DraftTokens is already parsed and comes back as it is.
    ValueError quoting a bad value."""
    if isinstance(value, DraftTokens):
        return value
    if isinstance(value, str):
        text = value.strip().lower()
        if text == "auto":
            return DraftTokens(AUTO_MAX_DRAFT_TOKENS, True)
        if text.startswith("auto:") and text[5:].isdigit():
            return DraftTokens(check_num_draft_tokens(int(text[5:])), True)
        if text.isdigit():
            return DraftTokens(check_num_draft_tokens(int(text)), False)
        raise ValueError(f"num_draft_tokens={value!r}: must be an integer in "
                         f"1..{MAX_DRAFT_TOKENS}, or auto / auto:K")
    return DraftTokens(check_num_draft_tokens(value), False)


@dataclass(frozen=True)
class SpeculationConfig:
    """How much to draft, and when not to (runtime/speculation/policy.py)."""

    # k: tokens drafted per step (a request may ask for its own); "auto" / "auto:K" (read into
    # num_draft_tokens = K, adaptive = True): each step drafts while a token pays for itself
    num_draft_tokens: int = 4
    adaptive: bool = False
    ngram_min: int = 1  # n-gram lookup: the shortest match it continues
    ngram_max: int = 4  # ... and the longest it tries first
    # suffix lookups (suffix, hybrid, auto) also draft from the engine folder's corpus table
    # of answers where it has one (`trt-spec corpus`)
    corpus: bool = True
    spec_max_batch: int | None = None  # more streams decoding: no drafting (None: no limit)
    # a stream's acceptance below this: plain steps (0: never)
    min_acceptance: float = option(0.0, "spec_min_acceptance")
    # a stream whose tokens per unit of cost (measured: runtime/speculation/cost_probe.py) fall below 1,
    # plain decoding's, over its last `window` speculative steps: plain steps for a cooldown
    fallback: bool = option(True, "spec_fallback")
    window: int = 32  # speculative steps in the acceptance and the gain windows
    cooldown: int = 16  # plain steps before such a stream drafts again; doubled each time
    max_cooldown: int = 256  # a probe that fails again, up to this
    # the gain rules draft only where a drafter is expected, and measured, to emit this share
    # more tokens per unit of time than plain decoding (0: break-even, the default: 0.03 with
    # measured_costs has not yet kept every method and k at >= 0.98x plain decoding on
    # held-out prompts, docs/benchmarks.md "The gain rules on prompts not seen")
    margin: float = 0.0
    # costs in the gain rules from each step's whole wall time (drafting, verifying,
    # committing), each drafter's against the model's c(T) (False, the default: the model)
    measured_costs: bool = False
    # structured outputs: the most tokens a grammar forces (allows one way only) drafted in a
    # step, for free, whatever the method (0: none)
    forced_tokens: int = 8
    # structured outputs: model drafters (vanilla, mtp, eagle, eagle3) draft under the
    # grammar's mask, its state advanced along the draft (runtime/proposers/base.py held)
    grammar_drafts: bool = True

    def __post_init__(self):
        if isinstance(self.num_draft_tokens, (str, DraftTokens)):
            k, adaptive = parse_num_draft_tokens(self.num_draft_tokens)
            object.__setattr__(self, "num_draft_tokens", k)
            object.__setattr__(self, "adaptive", adaptive)
        check_num_draft_tokens(self.num_draft_tokens)
        if not isinstance(self.corpus, bool):
            raise ValueError(f"corpus={self.corpus!r}: expected True or False")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError(f"ngram n range {self.ngram_min}..{self.ngram_max}: need "
                             "1 <= ngram_min <= ngram_max")
        if self.spec_max_batch is not None and self.spec_max_batch < 1:
            raise ValueError(f"spec_max_batch={self.spec_max_batch}: must be >= 1 (or None for "
                             "no limit)")
        if not 0 <= self.min_acceptance <= 1:
            raise ValueError(f"min_acceptance={self.min_acceptance}: must be in [0, 1]")
        if not isinstance(self.forced_tokens, int) or not 0 <= self.forced_tokens <= \
                MAX_DRAFT_TOKENS:
            raise ValueError(f"forced_tokens={self.forced_tokens!r}: must be an integer in "
                             f"0..{MAX_DRAFT_TOKENS} (0: none)")
        if not isinstance(self.grammar_drafts, bool):
            raise ValueError(f"grammar_drafts={self.grammar_drafts!r}: expected True or False")
        if not 0 <= self.margin < 1:
            raise ValueError(f"margin={self.margin}: must be in [0, 1) (a share of plain "
                             "decoding's speed)")
        if self.window < 1 or self.cooldown < 0 or self.max_cooldown < self.cooldown:
            raise ValueError(f"window={self.window}, cooldown={self.cooldown}, max_cooldown="
                             f"{self.max_cooldown}: need window >= 1, 0 <= cooldown <= "
                             "max_cooldown")


@dataclass(frozen=True)
class RuntimeConfig:
    """Everything a loaded engine folder runs with."""

    method: str = PLAIN  # the default method of requests that name none
    backend: str = "ort"  # ort | torch-cuda | trt
    device: str | None = None  # torch-cuda / trt: the device (default: cuda when available)
    threads: int | None = None  # ort: intra-op threads (default: TRT_SPEC_THREADS or all cores)
    cuda_graphs: bool = True  # torch-cuda / trt: one CUDA graph per shape bucket
    # which executor steps a request (runtime/executors.py): "device" (drafts, verification
    # and sampling on the device, runtime/device/loop.py) for every request it covers, the
    # others on the host with the reason recorded; "host" always the host (Engine); "auto":
    # the device on torch-cuda over a CUDA device, else the host
    executor: str = "auto"
    dtype: str = "float32"  # torch-cuda: the weights' and caches' dtype (float16, bfloat16)
    # ort: a token's logits do not depend on how many rows its step has, so speculative and
    # plain greedy decoding give the same tokens; False (`--fast-decode`) saves ~1-10% of a
    # plain step, and outputs can then differ at near-ties
    exact_decode: bool = True
    verify: str = "sha256"  # how the engine folder's files are checked on load
    max_batch: int = option(1, "max_num_seqs")  # KV-cache slots: streams decoded together
    # context per stream (prompt + output), capped by the model's
    max_len: int = option(2048, "max_model_len")
    max_prefill_tokens: int | None = DEFAULT_MAX_PREFILL_TOKENS  # per step (None: whole prompts)
    max_waiting: int | None = 64  # queued requests before `submit` refuses (None: no bound)
    # a finished request's KV slot keeps its rows; a prompt that starts with them reads only
    # the rest (runtime/prefix_cache.py); False: every prompt is read whole
    prefix_cache: bool = True
    # special tokens written in a prompt string or a chat message's content are read as plain
    # text (runtime/tokenizer.py escape_special); False: as control tokens, as transformers'
    # apply_chat_template and vLLM read them
    escape_special_tokens: bool = False
    # a chat template file (the template's text, or a JSON whose chat_template it is) used in
    # place of the engine folder's (runtime/chat_template.py); None: the folder's
    chat_template: str | None = None
    # step costs the engine measured (runtime/speculation/cost_probe.py) are kept outside the engine folder
    # and read by the next process on this machine (runtime/speculation/cost_cache.py); `serve` turns it on
    cost_cache: bool = False
    # the share of the available memory (host RAM, or the GPU's free memory) the weights and
    # KV caches may take (vLLM's gpu_memory_utilization); more refuses at load, before
    # anything heavy is read (runtime/memory.py); above 1: past what is available (swap)
    memory_utilization: float = 0.9
    speculation: SpeculationConfig = field(default_factory=SpeculationConfig)

    def __post_init__(self):
        if self.method not in METHOD_NAMES:
            raise ValueError(f"method {self.method!r} is not known; known: "
                             f"{', '.join(METHOD_NAMES)}")
        if self.backend not in BACKENDS:
            raise ValueError(f"backend={self.backend!r}: expected one of {', '.join(BACKENDS)}")
        if self.verify not in VERIFY:
            raise ValueError(f"verify={self.verify!r}: expected one of {', '.join(VERIFY)}")
        for name in ("max_batch", "max_len", "threads", "max_prefill_tokens"):
            value = getattr(self, name)
            least = 2 if name == "max_len" else 1
            if (value is not None or name in ("max_batch", "max_len")) and (
                    not isinstance(value, int) or isinstance(value, bool) or value < least):
                raise ValueError(f"{name}={value!r}: must be an integer >= {least}"
                                 + ("" if name in ("max_batch", "max_len") else " (or None)"))
        if self.max_waiting is not None and (not isinstance(self.max_waiting, int)
                                             or self.max_waiting < 0):
            raise ValueError(f"max_waiting={self.max_waiting!r}: must be >= 0 (or None for no "
                             "bound)")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype={self.dtype!r}: expected one of {', '.join(DTYPES)}")
        for name in ("prefix_cache", "cost_cache", "escape_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}={getattr(self, name)!r}: expected True or False")
        if self.chat_template is not None \
                and not isinstance(self.chat_template, (str, os.PathLike)):
            raise ValueError(f"chat_template={self.chat_template!r}: expected a file's path "
                             "(or None: the engine folder's template)")
        if isinstance(self.memory_utilization, bool) or not isinstance(
                self.memory_utilization, (int, float)) or not self.memory_utilization > 0:
            raise ValueError(f"memory_utilization={self.memory_utilization!r}: must be a "
                             "number > 0 (0.9: 90% of the available memory)")
        if self.executor not in EXECUTORS:
            raise ValueError(f"executor={self.executor!r}: expected one of "
                             f"{', '.join(EXECUTORS)}")
        if not isinstance(self.speculation, SpeculationConfig):
            raise ValueError(f"speculation={self.speculation!r}: expected a SpeculationConfig")

    @classmethod
    def option_names(cls) -> set[str]:
        """Every name from_options takes: fields and public names of RuntimeConfig and
        SpeculationConfig (what the CLI's runtime options are called)."""
        return {n for c in (cls, SpeculationConfig) for pair in option_names(c).items()
                for n in pair}

    @classmethod
    def from_options(cls, **options) -> "RuntimeConfig":
        """From flat keyword options: RuntimeConfig's fields and SpeculationConfig's (which
        override `speculation=` when both are given), each by its field name or its public
        name (max_num_seqs for max_batch, ...). Unknown names raise, listing the known."""
        unknown = sorted(set(options) - cls.option_names())
        if unknown:
            raise ValueError(f"unknown runtime options {unknown}; known: "
                             f"{', '.join(sorted(cls.option_names()))}")
        own = field_options(cls, options)
        spec = {k: v for k, v in field_options(SpeculationConfig, options).items()
                if k not in own}
        base = own.pop("speculation", None) or SpeculationConfig()
        return cls(**own, speculation=dataclasses.replace(base, **spec))

    def replace(self, **options) -> "RuntimeConfig":
        """A copy with flat options changed (as from_options)."""
        current = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        for public, name in option_names(RuntimeConfig).items():
            if public in options:  # a public name replaces the field's current value
                current.pop(name)
        return RuntimeConfig.from_options(**{**current, **options})
