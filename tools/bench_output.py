"""What `trt-spec bench` prints and writes: the text table, the JSON report and the chart."""

from __future__ import annotations

import json
import resource
from pathlib import Path


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def method_label(r: dict) -> str:
    """A result row's method, with its k where it drafts: "ngram k=4", "none"."""
    k = r["num_draft_tokens"]
    # a peer that sweeps k is already named by it ("llama.cpp-draft k=2")
    return r["method"] if k is None or r["method"].endswith(f" k={k}") else f"{r['method']} k={k}"


def table(results: list[dict], skipped_peers: dict | None = None) -> str:
    head = (f"{'engine':<32} {'method':<22} {'workload':<10} {'tok/s':>7} {'x none':>7} "
            f"{'x fast':>7} {'thru':>7} {'tau':>5} {'same':>5} {'valid':>5} {'propose us':>10} "
            f"{'ttft ms':>7} {'rss MB':>6}  acceptance by position")
    rows = [head, "-" * len(head)]

    def fmt(value, spec: str) -> str:
        return "" if value is None else format(value, spec)

    for r in results:
        label = method_label(r)
        engine = r["precision"] if r.get("peer") else Path(r["engine"]).name
        acc = " ".join(f"{a:.2f}" for a in r["acceptance_per_position"])
        if r.get("identical_to_own_plain") is not None:  # a speculating peer
            acc = (f"rate {fmt(r['acceptance_rate'], '.2f')}; same as its own plain "
                   f"{r['identical_to_own_plain']:.2f}")
        rows.append(f"{engine[:32]:<32} {label:<22} {r['workload']:<10} "
                    f"{fmt(r['tokens_per_s']['median'], '>7.1f'):>7} "
                    f"{fmt(r['speedup_vs_none'], '.2f'):>7} "
                    f"{fmt(r.get('speedup_vs_none_fast'), '.2f'):>7} "
                    f"{r['throughput_tokens_per_s']:>7.1f} {fmt(r['tau'], '.2f'):>5} "
                    f"{fmt(r['identical_to_baseline'], '.2f'):>5} "
                    f"{fmt(r.get('valid'), '.2f'):>5} "
                    f"{fmt(r['propose_us_per_step'], '.0f'):>10} "
                    f"{fmt(r.get('ttft_ms'), '.0f'):>7} {fmt(r.get('peak_rss_mb'), '.0f'):>6}  "
                    f"{acc}")
    rows.append(f"peak RSS {peak_rss_mb():.0f} MB (whole process; a peer in its own process: "
                "its own)")
    masked = [r for r in results if r.get("mask_us_per_step")]
    if masked:  # structured outputs (prompts with a json_schema)
        rows.append("grammar masks per decode step (made beside the target's forward, then "
                    "applied): " + ", ".join(
                        f"{method_label(r)} {r['mask_us_per_step']:.0f} us "
                        f"({100 * r['mask_us_per_step'] / r['score_us_per_step']:.1f}% of "
                        "scoring)" for r in masked if r.get("score_us_per_step")))
    for name, engine in dict.fromkeys((r["method"], r["engine"]) for r in results
                                      if r.get("peer")):
        rows.append(f"peer {name}: {engine}")
    ours = [r for r in results if "vs_peers" in r]
    if ours:
        names = list(ours[0]["vs_peers"])
        rows += ["", "ours / peer: median over prompt runs of (our tok/s / peer tok/s), same "
                     "prompt and pass; peers' 'x none' is peer / our none, medians"]
        rows.append(f"{'method':<22} {'workload':<10} " + " ".join(f"{n:>22}" for n in names))
        for r in ours:
            label = method_label(r)
            rows.append(f"{label:<22} {r['workload']:<10} "
                        + " ".join(f"{fmt(r['vs_peers'][n], '.2f'):>22}" for n in names))
    fastest = [r for r in results if r.get("fastest_peer")]
    if fastest:  # every row beside the fastest peer configuration, per workload
        rows += ["", "x fastest peer: median over prompt runs of (tok/s / the fastest peer "
                     "configuration's tok/s), same prompt and pass"]
        for r in fastest:
            rows.append(f"{method_label(r):<22} {r['workload']:<10} "
                        f"{fmt(r['ratio_to_fastest_peer'], '.2f'):>6}  (vs {r['fastest_peer']})")
    for name, reason in (skipped_peers or {}).items():
        rows.append(f"skipped peer {name}: {reason}")
    return "\n".join(rows)


def write_plot(report: dict, path: str | Path) -> None:
    """Bar chart of median tokens/s per method and peer (whiskers: min-max over runs), tau per
    method and peer in a second panel; one group of bars per workload."""
    try:
        import matplotlib
    except ImportError as e:
        raise ValueError("--plot needs matplotlib: pip install -e '.[bench]'") from e
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = report["results"]
    workloads = list(dict.fromkeys(r["workload"] for r in results))

    def label(r: dict) -> str:
        base = method_label(r)
        many = len(report["settings"]["engines"]) > 1 and not r.get("peer")
        return base + (f" [{Path(r['engine']).name}]" if many else "")

    labels = list(dict.fromkeys(label(r) for r in results))
    fig, (ax_rate, ax_tau) = plt.subplots(2, 1, figsize=(max(7, 0.9 * len(labels) * len(workloads)), 8),
                                          gridspec_kw={"height_ratios": [2, 1]})
    width = 0.8 / len(workloads)
    for w_i, workload in enumerate(workloads):
        rows = {label(r): r for r in results if r["workload"] == workload}
        xs = [i + (w_i - (len(workloads) - 1) / 2) * width for i in range(len(labels))]
        med, lo, hi, taus = [], [], [], []
        for name in labels:
            r = rows.get(name)
            runs = [x for x in (r["tokens_per_s"]["runs"] if r else []) if x is not None]
            m = r["tokens_per_s"]["median"] if r and r["tokens_per_s"]["median"] else 0.0
            med.append(m)
            lo.append(m - min(runs) if runs else 0.0)
            hi.append(max(runs) - m if runs else 0.0)
            taus.append(r["tau"] if r and r["tau"] is not None else 0.0)
        colors = ["tab:gray" if (rows.get(n) or {}).get("peer") else "tab:blue" for n in labels]
        ax_rate.bar(xs, med, width, yerr=[lo, hi], capsize=3, color=colors,
                    alpha=1.0 - 0.35 * w_i / max(len(workloads) - 1, 1), label=workload)
        ax_tau.bar(xs, taus, width, color=colors)
    for ax in (ax_rate, ax_tau):
        ax.set_xticks(range(len(labels)))
        ax.set_xticklabels(labels, rotation=30, ha="right")
    ax_rate.set_ylabel("decode tokens/s (median, min-max)")
    ax_tau.set_ylabel("tau (tokens / target forward)")
    ax_tau.axhline(1.0, color="black", linewidth=0.5)
    if len(workloads) > 1:
        ax_rate.legend()
    s = report["settings"]
    engines = ", ".join(Path(e).name for e in s["engines"])
    fig.suptitle(f"{engines}: {s['num_prompts']} prompts x {s['repeats']} passes, "
                 f"{s['max_new_tokens']} new tokens, k={','.join(map(str, s['num_draft_tokens']))}, "
                 f"temperature {s['temperature']}\n{report['machine']['cpu']} "
                 f"({report['machine']['cores']} cores); blue: ours, gray: peers (tau 0 = unknown)",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_json(path: str | Path, data: dict) -> None:
    with open(path, "w") as f:
        json.dump(data, f, indent=2)
