"""Which executor steps a request: the one place that decides.

The scheduler (runtime/scheduler.py) admits, steps and retires every stream, for every entry
point (serve, LLM, generate, bench). Each step of a stream is executed by one of two
executors, chosen once per request at its admission:

    host     runtime/engine.py Engine: the target's logits to NumPy, verification, sampling
             and every request feature on the host (any backend)
    device   runtime/device/loop.py DeviceExecutor: drafting, verification and sampling on
             the device, one copy back per step (CUDA graphs on a GPU); torch backends. A
             method that drafts on the host (suffix, hybrid, auto) uploads its drafts
             (runtime/device/host_drafts.py)

    settings.executor   "auto"    the device on torch-cuda over a CUDA device, else the host
                        "device"  the device wherever the backend declares a device runner
                                  (the CPU torch backend included: tests reach it so)
                        "host"    always the host

A request the device executor does not cover yet falls back to the host executor alone;
`fallback_reason` says why, and the stream keeps that reason (Stream.fallback, its
RequestMetrics.fallback and the step's StepMetrics.fallbacks), so a fallback is never silent.
The reasons are read from the methods' registry traits (runtime/methods.py `device`) and the
request's features, not from method names.
"""

from __future__ import annotations

from trt_spec.runtime.methods import METHODS
from trt_spec.runtime.stream import StepMetrics, Stream

HOST, DEVICE = "host", "device"


def device_wanted(gen) -> bool:
    """Whether gen's settings and backend send requests to the device executor."""
    want = gen.settings.executor
    if want == HOST or gen.backend == "ort":
        return False
    device = getattr(gen.graphs, "device", None)
    return want == DEVICE or (gen.backend == "torch-cuda" and str(device).startswith("cuda"))


def backend_reason(gen) -> str | None:
    """Why gen's backend has no device executor, or None when it has one."""
    from trt_spec.runtime.backends.base import DeviceGraphs, DeviceRunner

    if not isinstance(gen.target, DeviceRunner) or not isinstance(gen.graphs, DeviceGraphs):
        return f"the {gen.backend} backend has no device runner"
    return None


def fallback_reason(gen, s: Stream) -> str | None:
    """Why the device executor does not take s (the host does), or None when it does."""
    why = backend_reason(gen)
    if why is not None:
        return why
    if METHODS[s.method].device is None:
        return f"method {s.method} drafts on the host"
    ex = gen.device_executor
    if ex is not None and not ex.reserve(s):
        return (f"the device executor's {len(ex.loops)} method loops, each with caches "
                f"of its own, are all busy ({', '.join(ex.loops)})")
    return None


def choose(gen, s: Stream) -> None:
    """Sets s.executor (and s.fallback: why not the device, where the device was wanted)."""
    s.executor, s.fallback = HOST, None
    if device_wanted(gen):
        s.fallback = fallback_reason(gen, s)
        if s.fallback is None:
            s.executor = DEVICE


def admit(gen, s: Stream, source: Stream | None) -> None:
    """Chooses s's executor and gives s a KV slot. A choice i > 0 starts from choice 0's
    prompt rows (source: Engine.fork, or the device's slot copy when both run there) and a
    prompt may start from a kept slot's rows (the prefix cache: the host's slots, or the
    device loop's own caches, runtime/device/prefill.py)."""
    choose(gen, s)
    if s.executor == DEVICE:
        gen.engine.admit(s, reuse=False)
        gen.device_executor.admit(s, source if source and source.executor == DEVICE else None)
    else:
        gen.engine.admit(s, source=source if source and source.executor == HOST else None)


def execute(gen, streams: list[Stream], prefill_budget: int | None,
            admitted: list[Stream] = ()) -> StepMetrics:
    """One scheduler step of the running streams, each on its executor -> the metrics of
    both, with the reasons of the admitted streams that fell back to the host. The step's
    prefill_budget is shared: the host reads what the device's chunks left."""
    device = [s for s in streams if s.executor == DEVICE]
    host = [s for s in streams if s.executor == HOST]
    m = StepMetrics()
    if device:
        m.merge(gen.device_executor.step(device, prefill_budget))
        if prefill_budget is not None:
            prefill_budget -= m.prefill_tokens
    if host:  # (alone, its own metrics: a merge per step is a visible share of a plain step)
        part = gen.engine.step(host, prefill_budget)
        m = m.merge(part) if device else part
    for s in admitted:
        if s.fallback is not None:
            m.fallbacks[s.fallback] = m.fallbacks.get(s.fallback, 0) + 1
    return m


def release(gen, s: Stream, keep: bool = True) -> None:
    """Frees s's slot on its executor (keep: the prefix cache may keep its rows)."""
    if s.executor == DEVICE:
        gen.device_executor.release(s, keep)
    else:
        gen.engine.release(s, keep)
