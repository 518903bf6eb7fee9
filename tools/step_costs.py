"""c(T): what one target forward of T new tokens costs after a past of P tokens.

Speculation pays about tau / (c(k+1)/c(1) + drafting cost / c(1)), so the curve c(T)/c(1)
decides how much it can pay on a machine. Each (P, T) is timed `repeats` times, the Ts
interleaved within every repeat (1 2 .. 9 1 2 .. 9 ...) so drift hits them alike; the cache
is rewound to P after every step, as a rejected verification would be.

Within a repeat each T runs `block` steps in a row and only the last is timed: the runtime
repeats one shape step after step, and ONNX Runtime's first run of a new shape after another
costs more (measured here: a 1-token step alone 5.3 ms, alternating with 5-token steps 6.4 ms).
"""

from __future__ import annotations

import statistics
import time

from trt_spec.runtime.generator import Generator
from trt_spec.runtime.step_inputs import SlotTokens

# Filler for synthetic long pasts: plain prose, tokenized once and cut to length.
FILLER = (
    "The history of computing is a story of abstraction: each generation of engineers "
    "hides the details of the one before it, so that the next can think in larger pieces. ")


def synthetic_prompt(gen: Generator, length: int) -> list[int]:
    ids = gen.tokenizer.encode(FILLER, add_special_tokens=False)
    while len(ids) < length:
        ids = ids + ids
    return ids[:max(length, 1)]


def step_costs(gen: Generator, pasts: list[int], ts: list[int], repeats: int = 12,
               warmup: int = 2, block: int = 3) -> dict:
    """Returns {"ms": {P: {T: median ms}}, "ratio": {P: {T: c(T)/c(T_min)}}, "repeats"}."""
    if not ts or min(ts) < 1:
        raise ValueError(f"step sizes {ts}: need integers >= 1")
    cache, slot = gen.cache, gen.cache.allocate()
    try:
        ms: dict[int, dict[int, float]] = {}
        for past in pasts:
            if past < 1 or past + max(ts) > cache.max_len:
                raise ValueError(f"past {past}: with T up to {max(ts)} it needs 1.."
                                 f"{cache.max_len - max(ts)} (the cache holds {cache.max_len})")
            cache.lengths[slot] = 0
            gen.target.step(cache, [SlotTokens(slot, synthetic_prompt(gen, past), [past - 1])])
            tokens = synthetic_prompt(gen, max(ts))
            times = {t: [] for t in ts}
            for r in range(warmup + repeats):
                for t in ts:
                    for _ in range(block):
                        t0 = time.perf_counter()
                        gen.target.step(cache, [SlotTokens(slot, tokens[:t], list(range(t)))])
                        elapsed = time.perf_counter() - t0
                        cache.rewind(slot, past)
                    if r >= warmup:
                        times[t].append(elapsed)
            ms[past] = {t: 1000 * statistics.median(v) for t, v in times.items()}
    finally:
        cache.release(slot)
    base = min(ts)
    return {"ms": ms, "ratio": {p: {t: c / row[base] for t, c in row.items()}
                                for p, row in ms.items()}, "repeats": repeats, "block": block}


def table(result: dict) -> str:
    ts = list(next(iter(result["ms"].values())))
    head = "past   " + " ".join(f"{f'T={t}':>7}" for t in ts) + "   (ms; then c(T)/c(1))"
    lines = [head, "-" * len(head)]
    for past, row in result["ms"].items():
        lines.append(f"{past:<6} " + " ".join(f"{row[t]:7.2f}" for t in ts))
        lines.append(f"{'':<6} " + " ".join(f"{result['ratio'][past][t]:7.2f}" for t in ts))
    return "\n".join(lines)
