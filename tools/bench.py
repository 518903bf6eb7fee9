"""`trt-spec bench`: tokens/s, tau and acceptance per method, side by side in one process.

Every configuration (engine x method x k) runs on every prompt, interleaved (A B C A B C ...)
after a warm-up, so a comparison holds while the machine's speed drifts; the engines of one
folder share one loaded target and KV cache. Batch 1 by default; with --batch B, groups of B
prompts decode together (throughput is then the figure to read).

With --peers, other runtimes on the same model (tools/peers/) run inside the same loop: each
workload runs every configuration, then every peer, on the same prompt token ids. A peer that
cannot be installed or loaded, or fails while running, is reported under skipped_peers.
"""

from __future__ import annotations

import importlib.util
import json
import os
import platform
import statistics
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

from trt_spec.runtime.speculation.draft_length import DraftLength
from trt_spec.runtime.generator import Generator, encode_prompt
from trt_spec.runtime.manifest import load_manifest
from trt_spec.runtime.proposers.suffix import SuffixCache
from trt_spec.tools import peers as peer_registry
from trt_spec.tools.bench_peers import (PeerRunner, identical_share, load_peers, mean_of,
                                       peer_results, require_jsonschema, valid_json)
from trt_spec.tools.bench_output import peak_rss_mb, table, write_json, write_plot
from trt_spec.runtime.sampling import SamplingParams
from trt_spec.tools.bench_config import BenchConfig
from trt_spec.tools.bench_prompts import (PROMPTS, default_prompts_path, load_prompts,  # noqa: F401
                                         load_schemas, read_prompts)
from trt_spec.tools.speedup_model import k_max, measure_costs, predict, prediction_table, typical_past
from trt_spec.tools.step_costs import synthetic_prompt
from trt_spec.runtime.scheduler import generate_ids
from trt_spec.runtime.tokenizer import Tokenizer


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


def machine() -> dict:
    import onnxruntime

    from trt_spec.runtime.backends.cpu import cpu_flags, cpu_kind, cpu_name

    return {"cpu": cpu_name(), "cpu_flags": list(cpu_flags()), "kernels": cpu_kind(),
            "cores": os.cpu_count(), "python": platform.python_version(),
            "onnxruntime": onnxruntime.__version__, "platform": platform.platform()}


NONE_FAST = "none-fast"  # plain decoding with --fast-decode, timed beside exact plain decoding


@dataclass
class Config:
    engine: str
    method: str
    k: int | None  # None for "none"
    runs: dict = field(default_factory=dict)  # workload -> list of per-stream dicts
    groups: dict = field(default_factory=dict)  # workload -> list of (tokens, wall seconds)
    # its own cache of earlier requests (suffix, hybrid, auto): configurations run the same
    # prompts in turn, so a shared one would hand each the answer another config just wrote;
    # emptied before each pass (--repeats), or a pass would find its own answers from the last
    suffix_cache: SuffixCache = field(default_factory=SuffixCache)

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
    identical = identical_share(runs, baseline)
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
        "decode_steps": steps,
        "drafted_per_position": proposed_pp,  # steps that drafted at least i + 1 tokens
        # steps that drafted exactly k tokens, k = 0, 1, ... (adaptive k: what it chose)
        "drafted_k_histogram": ([steps - proposed_pp[0]] if proposed_pp else [steps]) + [
            proposed_pp[i] - (proposed_pp[i + 1] if i + 1 < width else 0) for i in range(width)],
        "identical_to_baseline": identical,
        # under a schema: the share of answers that parse and validate
        "valid": mean_of(r["valid"] for r in runs),
        "valid_runs": [r["valid"] for r in runs],  # in the order of tokens_per_s' runs
        "completion_tokens_mean": tokens / len(runs),
        "ttft_ms": statistics.median(r["ttft_s"] * 1000 for r in runs),
        "propose_us_per_step": 1e6 * sum(r["propose_s"] for r in runs) / steps,
        "score_us_per_step": 1e6 * sum(r["score_s"] for r in runs) / steps,
        "sample_us_per_step": 1e6 * sum(r["sample_s"] for r in runs) / steps,
        # structured outputs: the grammar's masks (inside sample), per step and per mask
        "mask_us_per_step": 1e6 * sum(r.get("mask_s", 0.0) for r in runs) / steps,
        "mask_us_per_mask": (1e6 * sum(r.get("mask_s", 0.0) for r in runs)
                             / max(1, sum(r.get("masks", 0) for r in runs))),
        "peak_rss_mb": peak_rss_mb(),
    }


def check_settings(config: BenchConfig, schemas: list) -> None:
    """ValueError for settings that cannot run together, before anything loads."""
    if any(schemas) and config.batch != 1:
        raise ValueError(f"--batch {config.batch}: prompts with a json_schema each run at batch 1")
    if any(schemas):
        require_jsonschema()
    if config.peers and config.batch != 1:
        raise ValueError(f"--peers runs at batch 1 only; got --batch {config.batch}")
    if config.peers and config.stop_at_eos:
        raise ValueError("--peers decode a fixed number of tokens (EOS ignored); drop "
                         "--stop-at-eos")


def comparable(config: BenchConfig) -> bool:
    """Greedy or seeded: every method must emit the baseline's tokens."""
    return config.temperature == 0 or config.seed is not None


def bench_methods(config: BenchConfig) -> list[str]:
    """The methods to run, 'none' first where identical_to_baseline or the peers' ratios
    need it."""
    methods = list(dict.fromkeys(config.methods))
    if "none" not in methods and (config.peers or (comparable(config)
                                                   and any(m != "none" for m in methods))):
        methods = ["none"] + methods
    return methods


def longest_prompt(engine: str, prompts: list) -> int:
    """The most tokens any of `prompts` takes, as engine's tokenizer encodes it."""
    tokenizer = Tokenizer(load_manifest(engine, verify="none").folder)
    return max((len(encode_prompt(tokenizer, p)) for p in prompts), default=0)


def load_engines(config: BenchConfig, methods: list[str], ks: list, prompts: list = ()
                 ) -> tuple[dict, list[Config]]:
    """A Generator per engine folder and a Config per engine x method x k (and none-fast
    beside exact none); a drafter that cannot load fails here, before any timing. Each
    context holds the longest of `prompts` and its answer (512 tokens at least)."""
    longest = max((longest_prompt(e, prompts) for e in config.engines), default=0)
    max_len = (max(list(config.pasts) + [512, longest]) + config.max_new_tokens
               + max([k_max(k) for k in ks] + [0]) + 8)
    gens, configs = {}, []
    for e in config.engines:
        # no prefix cache: every configuration reads the same prompts, and none may start
        # from another's rows
        gens[e] = Generator(e, max_batch=config.batch, max_len=max_len, threads=config.threads,
                            backend=config.backend, device=config.device,
                            executor=config.executor, exact_decode=config.exact_decode,
                            prefix_cache=False,
                            fallback=config.fallback, forced_tokens=config.forced_tokens,
                            corpus=config.corpus)
        for m in methods:
            for k in ([None] if m == "none" else ks):
                configs.append(Config(e, m, k))
            if m == "none" and config.exact_decode and hasattr(gens[e].target, "exact_decode"):
                configs.append(Config(e, NONE_FAST, None))  # what a user who does not
                # speculate would run: speed-ups are given against it too
    for c in configs:
        if c.method != NONE_FAST:
            gens[c.engine].proposer(gens[c.engine].check_method(c.method))
    return gens, configs


def make_workloads(prompts: list, batch: int, pasts: list[int]) -> list[tuple]:
    """(name, key, group): groups of `batch` prompts that decode together (the last group
    wraps around), key its index; then each synthetic past, key its length, group None."""
    groups = [[prompts[(g + j) % len(prompts)] for j in range(batch)]
              for g in range(0, len(prompts), batch)]
    return ([("prompts", i, group) for i, group in enumerate(groups)]
            + [(f"past={p}", p, None) for p in pasts])


@dataclass
class Session:
    """One bench run while it runs: what the steps of run_bench share."""
    config: BenchConfig
    prompts: list
    schemas: list[dict | None]
    methods: list[str]
    ks: list
    gens: dict[str, Generator]  # engine folder -> its loaded generator
    configs: list[Config]  # ours, in the interleaved order
    workloads: list[tuple]  # make_workloads
    params: SamplingParams
    progress: object  # print-like
    active: list = field(default_factory=list)  # the loaded peers
    skipped: dict = field(default_factory=dict)  # peer name -> why it did not run
    runner: PeerRunner | None = None

    @property
    def ref(self) -> Generator:
        """Peers take the first engine's prompt token ids and are compared with its none."""
        return self.gens[self.config.engines[0]]

    @property
    def workload_names(self) -> list[str]:
        return list(dict.fromkeys(w[0] for w in self.workloads))


def open_session(config: BenchConfig, progress) -> Session:
    ks = list(config.ks) or [4]
    prompts = load_prompts(config.prompts_file)[:config.num_prompts]
    schemas = load_schemas(config.prompts_file)[:config.num_prompts]
    check_settings(config, schemas)
    methods = bench_methods(config)
    gens, configs = load_engines(config, methods, ks, prompts)
    params = SamplingParams(max_tokens=config.max_new_tokens, temperature=config.temperature,
                            seed=config.seed, top_p=config.top_p,
                            ignore_eos=not config.stop_at_eos)
    return Session(config, prompts, schemas, methods, ks, gens, configs,
                   make_workloads(prompts, config.batch, list(config.pasts)), params, progress)


def load_peer_family(s: Session) -> None:
    """The peers named by --peers, loaded against the first engine's source model."""
    peers = list(s.config.peers)
    if peers:
        ctx = peer_registry.peer_context(s.ref.manifest.data, s.config.threads,
                                         k_max(s.ks[0]) if s.ks else 4, s.ref.manifest.folder)
        s.active = load_peers(peers, ctx, s.skipped, s.progress, s.ks,
                              structured=any(s.schemas))
    s.runner = PeerRunner(s.active, s.skipped, s.progress, s.ref.tokenizer.decode)


def run_config(s: Session, c: Config, name: str, prompts_ids: list[list[int]],
               sampling: SamplingParams | None = None) -> None:
    """One of our configurations on one group of prompts, recorded under workload `name`."""
    gen, exact_decode = s.gens[c.engine], s.config.exact_decode
    gen.use_suffix_cache(c.suffix_cache)
    fast = c.method == NONE_FAST
    rule = gen.engine.planner.draft_length
    if fast:  # the fastest plain decoding: 1-token steps on one-row kernels; its steps
        gen.target.exact_decode = False  # are not the engine's plain steps: not measured
        gen.engine.planner.draft_length = DraftLength()
    sampling = sampling or s.params
    t0 = time.perf_counter()
    try:
        streams = generate_ids(gen, prompts_ids, sampling, "none" if fast else c.method, c.k)
    finally:
        gen.target.exact_decode = exact_decode if fast else gen.target.exact_decode
        gen.engine.planner.draft_length = rule
    c.groups.setdefault(name, []).append((sum(len(x.output_ids) for x in streams),
                                          time.perf_counter() - t0))
    schema = json.loads(sampling.json_schema) if sampling.json_schema is not None else None
    for stream in streams:
        c.runs.setdefault(name, []).append(stream_record(stream, schema))


def stream_record(stream, schema: dict | None) -> dict:
    """What summarize() reads of one finished stream."""
    m = stream.metrics()
    return {
        "tokens_per_s": m.decode_tokens_per_s, "completion_tokens": m.completion_tokens,
        "target_forwards": m.target_forwards,
        "proposed_pp": list(m.proposed_per_position),
        "accepted_pp": list(m.accepted_per_position), "ttft_s": m.time_to_first_token_s,
        "propose_s": m.propose_s, "score_s": m.score_s, "sample_s": m.sample_s,
        "mask_s": m.mask_s, "masks": m.masks, "finish_reason": stream.finish_reason,
        "output_ids": stream.output_ids,
        "valid": valid_json(stream.text, schema) if schema is not None else None}


def warm_up(s: Session) -> None:
    """Not recorded: one-time work per batch size (the engine's cost probe,
    runtime/speculation/cost_probe.py) is done here, not in a run. Every size from 1 to
    `batch`: a group whose prompts are admitted over several steps decodes at the smaller
    sizes first. Then each peer once."""
    batch = s.config.batch
    warm = replace(s.params, max_tokens=min(s.params.max_tokens, 6))
    for c in s.configs:
        for size in range(1, batch + 1) if batch > 1 else [1]:
            run_config(s, c, "_warmup", [s.gens[c.engine].encode(s.prompts[0])[:16]] * size,
                       warm if size < batch else None)
        c.runs.pop("_warmup"), c.groups.pop("_warmup")
        c.suffix_cache = SuffixCache()  # what the warm-up wrote is not a request
    for p in list(s.active):
        s.runner.run(p, "_warmup", s.ref.encode(s.prompts[0])[:16], s.config.max_new_tokens,
                     s.config.temperature, peer_seed(s.config))
        p.runs.pop("_warmup", None), p.groups.pop("_warmup", None)


def peer_seed(config: BenchConfig) -> int:
    return config.seed if config.seed is not None else 0


def run_ours(s: Session, name: str, key: int, group: list | None) -> None:
    """Every configuration of ours on one workload, interleaved."""
    schema = s.schemas[key] if group is not None else None
    for c in s.configs:
        gen = s.gens[c.engine]
        ids = ([gen.encode(p) for p in group] if group is not None
               else [synthetic_prompt(gen, key)])
        run_config(s, c, name, ids, replace(s.params, json_schema=schema)
                   if schema is not None else None)


def run_peers(s: Session, name: str, key: int, group: list | None) -> None:
    """Then every peer, on the same ids (batch 1)."""
    schema = s.schemas[key] if group is not None else None
    ids = s.ref.encode(group[0]) if group is not None else synthetic_prompt(s.ref, key)
    for p in list(s.active):
        s.runner.run(p, name, ids, s.config.max_new_tokens, s.config.temperature,
                     peer_seed(s.config), schema)


def run_passes(s: Session) -> None:
    try:
        for rep in range(s.config.repeats):
            for c in s.configs:  # a prompt asked again would match its own earlier answer whole
                c.suffix_cache = SuffixCache()
            for name, key, group in s.workloads:
                run_ours(s, name, key, group)
                run_peers(s, name, key, group)
                s.progress(f"pass {rep + 1}/{s.config.repeats}: {name} #{key} done")
    finally:
        s.runner.close()


def collect_results(s: Session) -> list[dict]:
    """A summarize() row per configuration and workload, with its speed-ups over none and
    none-fast (same engine and workload)."""
    results = []
    for c in s.configs:
        precision = s.gens[c.engine].manifest.graph("target")["precision"]
        base = next((b for b in s.configs if b.engine == c.engine and b.method == "none"), None)
        for name in s.workload_names:
            baseline = (base.runs[name] if (base and comparable(s.config) and c is not base)
                        else None)
            results.append(summarize(c, name, c.runs[name], baseline, precision))
    for r in results:
        for method, key in (("none", "speedup_vs_none"), (NONE_FAST, "speedup_vs_none_fast")):
            base = next((x for x in results if x["engine"] == r["engine"]
                         and x["method"] == method and x["workload"] == r["workload"]), None)
            r[key] = (r["tokens_per_s"]["median"] / base["tokens_per_s"]["median"]
                      if base else None)
    return results


def add_predictions(s: Session, results: list[dict]) -> dict:
    """The speed-up each speculative config should reach, from c(T) measured here (batch 1);
    returns {engine: {"past", "ms"}}."""
    costs = {}
    if not (s.ks and any(c.k for c in s.configs) and s.config.batch == 1):
        return costs
    for e, gen in s.gens.items():
        past = typical_past([len(gen.encode(p)) for p in s.prompts], s.config.max_new_tokens)
        ms = measure_costs(gen, past, s.ks)
        costs[e] = {"past": past, "ms": ms}
        none = next((x for x in results if x["engine"] == e and x["method"] == "none"
                     and x["workload"] == "prompts"), None)
        for r in results:
            if (r["engine"] == e and r["num_draft_tokens"] and r["workload"] == "prompts"
                    and not r.get("peer")):
                predict(r, ms, none)
    return costs


# what each reported field means, written into the report's settings
FIELD_NOTES = {
    "ratio_pairwise": "peers: median over runs of (peer tok/s / our none tok/s) "
                      "on the same prompt and pass (first engine's none)",
    "vs_peers": "ours: median over runs of (our tok/s / peer tok/s) on the "
                "same prompt and pass",
    "ratio_to_fastest_peer": "every row: median over runs of (its tok/s / "
                             "the fastest peer configuration's tok/s) on the "
                             "same prompt and pass",
    "valid": "prompts with a json_schema: the share of answers that parse "
             "as JSON the schema accepts (jsonschema)",
    "tokens_per_s": "per stream, decode: (completion tokens - 1) / time after "
                    "its first token",
    "throughput_tokens_per_s": "per group of `batch` streams: all their tokens "
                               "/ wall time, prefill included",
    "peak_rss_mb": "the whole process (all configurations loaded)"}


def settings_report(s: Session) -> dict:
    config = s.config
    return {"engines": list(config.engines), "methods": s.methods, "num_draft_tokens": s.ks,
            "max_new_tokens": config.max_new_tokens, "temperature": config.temperature,
            "top_p": config.top_p,
            "prompts": str(config.prompts_file or default_prompts_path()),
            "backend": config.backend,
            "num_prompts": len(s.prompts), "stop_at_eos": config.stop_at_eos,
            "pasts": list(config.pasts), "repeats": config.repeats,
            "threads": config.threads, "batch": config.batch, "seed": config.seed,
            "exact_decode": config.exact_decode, "spec_fallback": config.fallback,
            "peers": list(config.peers), **FIELD_NOTES}


def run_bench(config: BenchConfig, progress=print) -> dict:
    """Ours and the peers on every workload, interleaved; returns the report (settings,
    machine, step costs, a result row per configuration and workload, the table)."""
    s = open_session(config, progress)
    load_peer_family(s)
    warm_up(s)
    run_passes(s)
    results = collect_results(s)
    costs = add_predictions(s, results)
    ref_none = next((c for c in s.configs if c.engine == config.engines[0]
                     and c.method == "none"), None)
    peer_results(s.active, s.configs, results, ref_none, s.workload_names, config.temperature)
    report = {"settings": settings_report(s), "machine": machine(), "step_costs_ms": costs,
              "results": results}
    if config.peers:
        report["skipped_peers"] = s.skipped
    report["table"] = (table(results, s.skipped if config.peers else None)
                       + prediction_table(results, costs))
    return report


def bench_report(config: BenchConfig, progress=print, json_out: str | Path | None = None,
                 plot_out: str | Path | None = None) -> str:
    """`trt-spec bench`: run_bench, the report written to `json_out` and its chart to
    `plot_out`; returns the table. ValueError for a setting that cannot run."""
    if plot_out and importlib.util.find_spec("matplotlib") is None:
        raise ValueError("--plot needs matplotlib: pip install -e '.[bench]'")
    report = run_bench(config, progress)
    text = report.pop("table")
    if json_out:
        write_json(json_out, report)
    if plot_out:
        write_plot(report, plot_out)
        progress(f"plot: {plot_out}")
    return text


def step_costs_report(engine: str, pasts: list[int], threads: int | None = None,
                      exact_decode: bool = True, json_out: str | Path | None = None) -> str:
    """`trt-spec bench --step-costs`: c(T) for T = 1..9 after each past (default 64) on the
    engine's target; written to `json_out`; returns the table."""
    from trt_spec.tools.step_costs import step_costs, table as costs_table

    pasts = list(pasts) or [64]
    gen = Generator(engine, threads=threads, max_len=max(pasts) + 16, exact_decode=exact_decode)
    result = step_costs(gen, pasts, list(range(1, 10)))
    if json_out:
        write_json(json_out, result)
    return costs_table(result)
