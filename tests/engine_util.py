"""An Engine over a generator's target and cache with a proposer a test made itself."""

from trt_spec.runtime.engine import Engine
from trt_spec.runtime.stream import Stream
from trt_spec.runtime.settings import SpeculationConfig


def engine_with(gen, proposer, config: SpeculationConfig) -> Engine:
    """Streams of method "custom" draft with `proposer` (see custom_stream)."""
    return Engine(gen.target, gen.cache, gen.stops, config,
                  lambda method: None if method == "none" else proposer)


def custom_stream(prompt, params, k: int) -> Stream:
    return Stream(list(prompt), params, "custom", k)
