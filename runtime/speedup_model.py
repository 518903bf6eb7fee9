"""What speculation should gain, from its measured parts, beside what it gained.

    predicted = tau / (c(k+1)/c(1) + drafting / c(1))

c(T) is one target forward of T new tokens (runtime/step_costs.py), measured in the same
process at the workload's typical context (median prompt + half the new tokens); drafting is
the proposer's time per step and tau the tokens per target forward, both from the run itself.
measured / predicted is what the loop keeps: sampling, commits and Python are what it loses.
"""

from __future__ import annotations

import statistics


def typical_past(prompt_lengths: list[int], max_new_tokens: int) -> int:
    return int(statistics.median(prompt_lengths)) + max_new_tokens // 2


def measure_costs(gen, past: int, ks: list[int], repeats: int = 8) -> dict[int, float]:
    """c(T) in ms for T = 1 and every k + 1, at `past` (clamped to what the cache holds)."""
    from trt_spec.runtime.step_costs import step_costs  # it imports bench, which imports us

    ts = sorted({1, *(k + 1 for k in ks)})
    past = max(1, min(past, gen.cache.max_len - max(ts)))
    return step_costs(gen, [past], ts, repeats=repeats, warmup=1)["ms"][past]


def predict(result: dict, costs_ms: dict[int, float]) -> None:
    """Adds the prediction fields to one speculative bench result (in place)."""
    k, c1 = result["num_draft_tokens"], costs_ms[1]
    verify = costs_ms[k + 1] / c1
    drafting = result["propose_us_per_step"] / 1000 / c1
    result["verify_cost_ratio"] = verify  # c(k+1) / c(1)
    result["drafting_cost_ratio"] = drafting  # drafting per step / c(1)
    result["predicted_speedup"] = result["tau"] / (verify + drafting)
    measured = result.get("speedup_vs_none")
    result["speedup_efficiency"] = (measured / result["predicted_speedup"]
                                    if measured is not None else None)


def prediction_table(results: list[dict], costs: dict[str, dict]) -> str:
    rows = [r for r in results if "predicted_speedup" in r]
    if not rows:
        return ""
    head = (f"{'method':<14} {'tau':>5} {'c(k+1)/c(1)':>11} {'draft/c(1)':>10} "
            f"{'predicted':>9} {'measured':>8} {'kept':>5}")
    lines = ["", "speed-up predicted from measured parts: tau / (c(k+1)/c(1) + drafting/c(1))"]
    for engine, c in costs.items():
        lines.append(f"c(T) ms at past {c['past']} ({engine}): "
                     + " ".join(f"T={t} {ms:.2f}" for t, ms in c["ms"].items()))
    lines += [head, "-" * len(head)]
    for r in rows:
        measured = "" if r["speedup_vs_none"] is None else f"{r['speedup_vs_none']:.2f}"
        kept = "" if r["speedup_efficiency"] is None else f"{r['speedup_efficiency']:.2f}"
        lines.append(f"{r['method'] + ' k=' + str(r['num_draft_tokens']):<14} {r['tau']:>5.2f} "
                     f"{r['verify_cost_ratio']:>11.2f} {r['drafting_cost_ratio']:>10.2f} "
                     f"{r['predicted_speedup']:>9.2f} {measured:>8} {kept:>5}")
    return "\n".join(lines)
