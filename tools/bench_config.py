"""What one `trt-spec bench` run times: light, so the command line reads its defaults without
importing the runtime."""

from __future__ import annotations

from dataclasses import dataclass

from trt_spec.runtime.sampling import SamplingParams
from trt_spec.runtime.options import option
from trt_spec.runtime.settings import SpeculationConfig


@dataclass(frozen=True)
class BenchConfig:
    """One `trt-spec bench` run: what is timed, on what, how often."""

    engines: tuple[str, ...]
    methods: tuple[str, ...] = ("none",)
    # draft lengths, each method but none at each
    ks: tuple[int, ...] = (SpeculationConfig.num_draft_tokens,)
    max_new_tokens: int = SamplingParams.max_tokens
    prompts_file: str | None = None  # None: the shipped prompts
    num_prompts: int | None = None  # the first N (None: all)
    pasts: tuple[int, ...] = ()  # also decode after synthetic prompts of these lengths
    repeats: int = 2
    temperature: float = 0.0
    top_p: float = 1.0  # sampling: nucleus (1: off)
    # sampling: None draws a fresh seed per request; with a seed every method emits plain
    # decoding's tokens, so identical_to_baseline is measured
    seed: int | None = None
    batch: int = 1
    stop_at_eos: bool = False
    peers: tuple[str, ...] = ()
    threads: int | None = None
    exact_decode: bool = True
    backend: str = "ort"
    device: str | None = None
    executor: str = "auto"  # runtime/executors.py: auto | host | device
    # the policy's gain rules (False: every step drafts its k)
    fallback: bool = option(True, "spec_fallback")
    # suffix lookups also draft from the engine folder's corpus table (where it has one)
    corpus: bool = True
    # structured outputs (prompts whose lines carry a json_schema): grammar-forced tokens
    # drafted per step (0: none, to measure what they add)
    forced_tokens: int = SpeculationConfig.forced_tokens

    def __post_init__(self):
        for name in ("engines", "methods", "ks", "pasts", "peers"):
            object.__setattr__(self, name, tuple(getattr(self, name)))
