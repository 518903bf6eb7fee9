"""What speculation should gain, from its measured parts, beside what it gained.

    predicted = tau / (E[c(k_i + 1)] / c(1) + drafting / c(1))

c(T) is one target forward of T new tokens (tools/step_costs.py), measured in the same
process at the workload's typical context (median prompt + half the new tokens); k_i is what
a step actually drafted (n-gram lookup drafts fewer than k, or none, when nothing matches), so
E[c(k_i + 1)] weighs c(1) .. c(k + 1) by how many steps drafted 0 .. k tokens; drafting is the
proposer's time per step and tau the tokens per target forward, all from the run itself.
measured / predicted is what the loop keeps: sampling, commits and Python are what it loses.

The same prediction from the run's own step times, tau / ((propose + score) per step / `none`'s
score per step), leaves out only what is not a graph call (sampling, commits, Python), so
measured / that (`loop_efficiency`) is the loop's waste alone, free of the isolated c(T)'s noise.
"""

from __future__ import annotations

import statistics

from trt_spec.tools.step_costs import step_costs


def typical_past(prompt_lengths: list[int], max_new_tokens: int) -> int:
    return int(statistics.median(prompt_lengths)) + max_new_tokens // 2


def k_max(k) -> int:
    """The most tokens a step drafts at draft length k (an int, or "auto:K")."""
    from trt_spec.runtime.settings import parse_num_draft_tokens

    return parse_num_draft_tokens(k)[0]


def measure_costs(gen, past: int, ks: list, repeats: int = 8) -> dict[int, float]:
    """c(T) in ms for T = 1 .. max(ks) + 1, at `past` (clamped to what the cache holds)."""
    ts = list(range(1, max(k_max(k) for k in ks) + 2))
    past = max(1, min(past, gen.cache.max_len - max(ts)))
    return step_costs(gen, [past], ts, repeats=repeats, warmup=1)["ms"][past]


def predict(result: dict, costs_ms: dict[int, float], none: dict | None = None) -> None:
    """Adds the prediction fields to one speculative bench result (in place); `none` is the
    same engine and workload's plain-decoding result."""
    k, c1 = k_max(result["num_draft_tokens"]), costs_ms[1]
    steps, drafted = result["decode_steps"], result["drafted_per_position"] + [0] * (k + 1)
    # steps that drafted exactly j tokens: drafted[j-1] - drafted[j]; none: steps - drafted[0]
    exactly = [max(steps - drafted[0], 0)] + [drafted[j - 1] - drafted[j] for j in range(1, k + 1)]
    verify = sum(n * costs_ms[j + 1] for j, n in enumerate(exactly)) / max(sum(exactly), 1) / c1
    drafting = result["propose_us_per_step"] / 1000 / c1
    result["verify_cost_ratio"] = verify  # E[c(k_i + 1)] / c(1)
    result["drafting_cost_ratio"] = drafting  # drafting per step / c(1)
    result["predicted_speedup"] = result["tau"] / (verify + drafting)
    measured = result.get("speedup_vs_none")
    result["speedup_efficiency"] = (measured / result["predicted_speedup"]
                                    if measured is not None else None)
    result["loop_efficiency"] = None
    if none is not None and measured is not None and none["score_us_per_step"]:
        step = result["propose_us_per_step"] + result["score_us_per_step"]
        result["loop_efficiency"] = measured / (result["tau"] * none["score_us_per_step"] / step)


def prediction_table(results: list[dict], costs: dict[str, dict]) -> str:
    rows = [r for r in results if "predicted_speedup" in r]
    if not rows:
        return ""
    head = (f"{'method':<14} {'tau':>5} {'verify/c(1)':>11} {'draft/c(1)':>10} "
            f"{'predicted':>9} {'measured':>8} {'kept':>5} {'loop':>5}")
    lines = ["", "speed-up predicted from measured parts: tau / (E[c(k_i+1)]/c(1) + drafting/c(1)),"
             " k_i the tokens a step drafted; kept = measured / predicted; loop = measured / the"
             " same from the run's own propose + score times (what sampling and Python cost)"]
    for engine, c in costs.items():
        lines.append(f"c(T) ms at past {c['past']} ({engine}): "
                     + " ".join(f"T={t} {ms:.2f}" for t, ms in c["ms"].items()))
    lines += [head, "-" * len(head)]
    for r in rows:
        measured = "" if r["speedup_vs_none"] is None else f"{r['speedup_vs_none']:.2f}"
        kept = "" if r["speedup_efficiency"] is None else f"{r['speedup_efficiency']:.2f}"
        loop = "" if r["loop_efficiency"] is None else f"{r['loop_efficiency']:.2f}"
        lines.append(f"{r['method'] + ' k=' + str(r['num_draft_tokens']):<14} {r['tau']:>5.2f} "
                     f"{r['verify_cost_ratio']:>11.2f} {r['drafting_cost_ratio']:>10.2f} "
                     f"{r['predicted_speedup']:>9.2f} {measured:>8} {kept:>5} {loop:>5}")
    return "\n".join(lines)
