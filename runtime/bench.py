"""`trt-spec bench`: decode speed, batch 1, greedy, engines and methods interleaved so that a
comparison holds while the machine's speed drifts."""

from __future__ import annotations

import platform
import resource
import statistics
from pathlib import Path

from trt_spec.runtime.generator import Generator
from trt_spec.runtime.sampling import SamplingParams

PROMPTS = [
    "What is the capital of France, and why is it famous?",
    "Write a short poem about the sea.",
    "Explain how a bicycle works to a child.",
    "Give me three tips for learning a new language.",
    "What is the difference between a virus and a bacterium?",
    "Write a Python function that reverses a string.",
    "Summarize the plot of Romeo and Juliet in a few sentences.",
    "Why is the sky blue?",
]

# Filler for synthetic long pasts: plain prose, tokenized once and cut to length.
FILLER = " ".join(PROMPTS) + " " + (
    "The history of computing is a story of abstraction: each generation of engineers "
    "hides the details of the one before it, so that the next can think in larger pieces. ")


def parse_past(text: str) -> list[int]:
    if not text.strip():
        return []
    try:
        values = [int(x) for x in text.split(",")]
    except ValueError:
        raise ValueError(f"--past {text!r}: expected comma-separated integers, e.g. 0,512,1024")
    if any(v < 0 for v in values):
        raise ValueError(f"--past {text!r}: lengths must be >= 0")
    return values


def synthetic_prompt(gen: Generator, length: int) -> list[int]:
    ids = gen.tokenizer.encode(FILLER, add_special_tokens=False)
    while len(ids) < length:
        ids = ids + ids
    return ids[:max(length, 1)]


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def run_bench(engines: list[str], methods: list[str], max_tokens: int, num_prompts: int,
              pasts: list[int], repeats: int, threads: int | None, progress=print) -> dict:
    max_len = max(pasts + [512]) + max_tokens + 8
    gens = {}
    for e in engines:
        for m in methods:
            gens[(e, m)] = Generator(e, method=m, max_batch=1, max_len=max_len, threads=threads)
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    cases = [("chat", i, p) for i, p in enumerate(PROMPTS[:num_prompts])]
    cases += [("past", p, None) for p in pasts]
    samples: dict[tuple, list[float]] = {}
    # warm-up: one short run per configuration
    for gen in gens.values():
        gen.generate_ids([gen.encode(PROMPTS[0])], SamplingParams(max_tokens=8, ignore_eos=True))
    for rep in range(repeats):
        for kind, key, prompt in cases:
            for (e, m), gen in gens.items():  # interleaved: A B A B ...
                ids = gen.encode(prompt) if kind == "chat" else synthetic_prompt(gen, key)
                s = gen.generate_ids([ids], params)[0]
                rate = s.metrics()["decode_tokens_per_s"]
                group = "chat" if kind == "chat" else f"past={key}"
                samples.setdefault((e, m, group), []).append(rate)
            progress(f"pass {rep + 1}/{repeats}: {kind} {key} done")
    results = []
    for (e, m, group), rates in samples.items():
        gen = gens[(e, m)]
        graph = gen.manifest.graph("target")
        results.append({
            "engine": str(Path(e)), "method": m, "precision": graph["precision"],
            "workload": group, "runs": len(rates),
            "decode_tokens_per_s_median": statistics.median(rates),
            "decode_tokens_per_s_min": min(rates), "decode_tokens_per_s_max": max(rates),
        })
    header = f"{'engine':<32} {'method':<8} {'precision':<9} {'workload':<10} {'tok/s (median)':>15} {'min-max':>15}"
    rows = [header, "-" * len(header)]
    for r in results:
        rows.append(f"{r['engine']:<32} {r['method']:<8} {r['precision']:<9} {r['workload']:<10} "
                    f"{r['decode_tokens_per_s_median']:>15.1f} "
                    f"{r['decode_tokens_per_s_min']:>7.1f}-{r['decode_tokens_per_s_max']:<7.1f}")
    rows.append(f"peak RSS {peak_rss_mb():.0f} MB (whole process, all engines loaded)")
    return {
        "settings": {"max_tokens": max_tokens, "prompts": num_prompts, "pasts": pasts,
                     "repeats": repeats, "threads": threads, "batch": 1, "greedy": True,
                     "machine": platform.processor() or platform.machine()},
        "results": results,
        "peak_rss_mb": peak_rss_mb(),
        "table": "\n".join(rows),
    }
