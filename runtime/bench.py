"""`trt-spec bench`: tokens/s, tau and acceptance per method, side by side in one process.

Every configuration (engine x method x k) runs on every prompt, interleaved (A B C A B C ...)
after a warm-up, so a comparison holds while the machine's speed drifts; the engines of one
folder share one loaded target and KV cache. Batch 1 by default; with --batch B, groups of B
prompts decode together (throughput is then the figure to read).
"""

from __future__ import annotations

import json
import os
import platform
import resource
import statistics
import time
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

from trt_spec.runtime.generator import Generator
from trt_spec.runtime.policy import SpeculationConfig
from trt_spec.runtime.sampling import SamplingParams
from trt_spec.runtime.speedup_model import measure_costs, predict, prediction_table, typical_past

# Filler for synthetic long pasts: plain prose, tokenized once and cut to length.
FILLER = (
    "The history of computing is a story of abstraction: each generation of engineers "
    "hides the details of the one before it, so that the next can think in larger pieces. ")


def default_prompts_path() -> Path:
    return Path(str(resources.files("trt_spec.runtime") / "data" / "prompts.jsonl"))


def load_prompts(path: str | Path | None) -> list:
    """FILE.jsonl: one object per line, {"prompt": "..."} or {"messages": [...]}."""
    path = Path(path) if path else default_prompts_path()
    if not path.is_file():
        raise ValueError(f"--prompts {str(path)!r}: no such file")
    prompts = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{n}: not JSON ({e})") from e
        if isinstance(obj, dict) and isinstance(obj.get("prompt"), str):
            prompts.append(obj["prompt"])
        elif isinstance(obj, dict) and isinstance(obj.get("messages"), list):
            prompts.append(obj["messages"])
        else:
            raise ValueError(f'{path}:{n}: expected {{"prompt": "..."}} or {{"messages": [...]}}')
    if not prompts:
        raise ValueError(f"{path}: no prompts")
    return prompts


PROMPTS = load_prompts(None)  # the default prompts, as plain strings


def parse_ints(text: str, option: str, minimum: int = 0) -> list[int]:
    if not text.strip():
        return []
    try:
        values = [int(x) for x in text.split(",")]
    except ValueError:
        raise ValueError(f"{option} {text!r}: expected comma-separated integers")
    if any(v < minimum for v in values):
        raise ValueError(f"{option} {text!r}: values must be >= {minimum}")
    return values


def parse_past(text: str) -> list[int]:
    return parse_ints(text, "--past")


def synthetic_prompt(gen: Generator, length: int) -> list[int]:
    ids = gen.tokenizer.encode(FILLER, add_special_tokens=False)
    while len(ids) < length:
        ids = ids + ids
    return ids[:max(length, 1)]


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def machine() -> dict:
    cpu = platform.processor() or platform.machine()
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    import onnxruntime

    return {"cpu": cpu, "cores": os.cpu_count(), "python": platform.python_version(),
            "onnxruntime": onnxruntime.__version__, "platform": platform.platform()}


@dataclass
class Config:
    engine: str
    method: str
    k: int | None  # None for "none"
    runs: dict = field(default_factory=dict)  # workload -> list of per-stream dicts
    groups: dict = field(default_factory=dict)  # workload -> list of (tokens, wall seconds)

    @property
    def label(self) -> str:
        return self.method if self.k is None else f"{self.method} k={self.k}"


def summarize(cfg: Config, workload: str, runs: list[dict], baseline: list[dict] | None,
              precision: str) -> dict:
    rates = [r["tokens_per_s"] for r in runs]
    tokens = sum(r["completion_tokens"] for r in runs)
    forwards = sum(r["target_forwards"] for r in runs)
    steps = sum(max(r["target_forwards"] - 1, 1) for r in runs)  # decode steps (no prefill)
    width = max((len(r["proposed_pp"]) for r in runs), default=0)
    proposed_pp = [sum(r["proposed_pp"][i] for r in runs if i < len(r["proposed_pp"]))
                   for i in range(width)]
    accepted_pp = [sum(r["accepted_pp"][i] for r in runs if i < len(r["accepted_pp"]))
                   for i in range(width)]
    identical = None
    if baseline is not None:
        same = [r["output_ids"] == b["output_ids"] for r, b in zip(runs, baseline)]
        identical = sum(same) / len(same)
    return {
        "engine": cfg.engine, "precision": precision, "method": cfg.method,
        "num_draft_tokens": cfg.k, "workload": workload,
        "tokens_per_s": {"median": statistics.median(rates), "runs": rates},
        # all streams of a group together: generated tokens / wall time, prefill included
        "throughput_tokens_per_s": (sum(t for t, _ in cfg.groups[workload])
                                    / sum(w for _, w in cfg.groups[workload])),
        "tau": tokens / forwards,
        "acceptance_rate": (sum(accepted_pp) / sum(proposed_pp)) if sum(proposed_pp) else None,
        "acceptance_per_position": [a / p for a, p in zip(accepted_pp, proposed_pp)],
        "identical_to_baseline": identical,
        "ttft_ms": statistics.median(r["ttft_s"] * 1000 for r in runs),
        "propose_us_per_step": 1e6 * sum(r["propose_s"] for r in runs) / steps,
        "score_us_per_step": 1e6 * sum(r["score_s"] for r in runs) / steps,
        "sample_us_per_step": 1e6 * sum(r["sample_s"] for r in runs) / steps,
        "peak_rss_mb": peak_rss_mb(),
    }


def run_bench(engines: list[str], methods: list[str], ks: list[int], max_new_tokens: int,
              prompts_file: str | None, pasts: list[int], repeats: int, temperature: float,
              threads: int | None, seed: int = 0, batch: int = 1, progress=print,
              num_prompts: int | None = None, stop_at_eos: bool = False,
              exact_decode: bool = True) -> dict:
    prompts = load_prompts(prompts_file)[:num_prompts]
    methods = list(dict.fromkeys(methods))
    if temperature == 0 and any(m != "none" for m in methods) and "none" not in methods:
        methods = ["none"] + methods  # identical_to_baseline needs the plain output
    max_len = max(pasts + [512]) + max_new_tokens + max(ks + [0]) + 8
    gens, configs = {}, []
    for e in engines:
        gens[e] = Generator(e, max_batch=batch, max_len=max_len, threads=threads,
                            exact_decode=exact_decode)
        for m in methods:
            for k in ([None] if m == "none" else ks):
                configs.append(Config(e, m, k))
    built = {}
    for c in configs:
        spec = SpeculationConfig(num_draft_tokens=c.k) if c.k else None
        built[id(c)] = gens[c.engine].make_engine(c.method, spec)
    # groups of `batch` prompts decode together (the last group wraps around)
    groups = [[prompts[(g + j) % len(prompts)] for j in range(batch)]
              for g in range(0, len(prompts), batch)]
    workloads = [("prompts", i, group) for i, group in enumerate(groups)]
    workloads += [(f"past={p}", p, None) for p in pasts]
    params = SamplingParams(max_tokens=max_new_tokens, temperature=temperature, seed=seed,
                            ignore_eos=not stop_at_eos)

    def run(c: Config, name: str, prompts_ids: list[list[int]]) -> None:
        gen = gens[c.engine]
        gen.engine = built[id(c)]
        t0 = time.perf_counter()
        streams = gen.generate_ids(prompts_ids, params)
        c.groups.setdefault(name, []).append((sum(len(s.output_ids) for s in streams),
                                              time.perf_counter() - t0))
        for s in streams:
            m = s.metrics()
            c.runs.setdefault(name, []).append({
                "tokens_per_s": m["decode_tokens_per_s"], "completion_tokens": len(s.output_ids),
                "target_forwards": s.target_forwards, "proposed_pp": s.proposed_per_position,
                "accepted_pp": s.accepted_per_position, "ttft_s": m["time_to_first_token_s"],
                "propose_s": s.propose_s, "score_s": s.score_s, "sample_s": s.sample_s,
                "output_ids": s.output_ids})

    for c in configs:  # warm-up, not recorded
        run(c, "_warmup", [gens[c.engine].encode(prompts[0])[:16]])
        c.runs.pop("_warmup"), c.groups.pop("_warmup")
    for rep in range(repeats):
        for name, key, group in workloads:
            for c in configs:  # interleaved
                gen = gens[c.engine]
                ids = ([gen.encode(p) for p in group] if group is not None
                       else [synthetic_prompt(gen, key)])
                run(c, name, ids)
            progress(f"pass {rep + 1}/{repeats}: {name} #{key} done")
    results = []
    for c in configs:
        precision = gens[c.engine].manifest.graph("target")["precision"]
        base = next((b for b in configs if b.engine == c.engine and b.method == "none"), None)
        for name in dict.fromkeys(w[0] for w in workloads):
            baseline = base.runs[name] if (base and temperature == 0 and c is not base) else None
            results.append(summarize(c, name, c.runs[name], baseline, precision))
    for r in results:
        none = next((x for x in results if x["engine"] == r["engine"] and x["method"] == "none"
                     and x["workload"] == r["workload"]), None)
        r["speedup_vs_none"] = (r["tokens_per_s"]["median"] / none["tokens_per_s"]["median"]
                                if none else None)
    costs = {}  # the speed-up each speculative config should reach, from c(T) measured here
    if ks and any(c.k for c in configs) and batch == 1:
        for e, gen in gens.items():
            past = typical_past([len(gen.encode(p)) for p in prompts], max_new_tokens)
            ms = measure_costs(gen, past, ks)
            costs[e] = {"past": past, "ms": ms}
            for r in results:
                if r["engine"] == e and r["num_draft_tokens"] and r["workload"] == "prompts":
                    predict(r, ms)
    report = {
        "settings": {"engines": engines, "methods": methods, "num_draft_tokens": ks,
                     "max_new_tokens": max_new_tokens, "temperature": temperature,
                     "prompts": str(prompts_file or default_prompts_path()),
                     "num_prompts": len(prompts), "stop_at_eos": stop_at_eos,
                     "pasts": pasts, "repeats": repeats,
                     "threads": threads, "batch": batch, "seed": seed,
                     "exact_decode": exact_decode,
                     "tokens_per_s": "per stream, decode: (completion tokens - 1) / time after "
                                     "its first token",
                     "throughput_tokens_per_s": "per group of `batch` streams: all their tokens "
                                                "/ wall time, prefill included",
                     "peak_rss_mb": "the whole process (all configurations loaded)"},
        "machine": machine(),
        "step_costs_ms": costs,
        "results": results,
    }
    report["table"] = table(results) + prediction_table(results, costs)
    return report


def table(results: list[dict]) -> str:
    head = (f"{'engine':<28} {'method':<12} {'workload':<10} {'tok/s':>7} {'x none':>7} {'thru':>7} "
            f"{'tau':>5} {'same':>5} {'propose us':>10}  acceptance by position")
    rows = [head, "-" * len(head)]
    for r in results:
        label = r["method"] if r["num_draft_tokens"] is None else f"{r['method']} k={r['num_draft_tokens']}"
        same = "" if r["identical_to_baseline"] is None else f"{r['identical_to_baseline']:.2f}"
        speed = "" if r["speedup_vs_none"] is None else f"{r['speedup_vs_none']:.2f}"
        acc = " ".join(f"{a:.2f}" for a in r["acceptance_per_position"])
        rows.append(f"{Path(r['engine']).name:<28} {label:<12} {r['workload']:<10} "
                    f"{r['tokens_per_s']['median']:>7.1f} {speed:>7} "
                    f"{r['throughput_tokens_per_s']:>7.1f} {r['tau']:>5.2f} {same:>5} "
                    f"{r['propose_us_per_step']:>10.0f}  {acc}")
    rows.append(f"peak RSS {peak_rss_mb():.0f} MB (whole process)")
    return "\n".join(rows)
