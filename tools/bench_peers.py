"""The peers' part of `trt-spec bench --peers` (tools/peers/): loading them, one run each on
the prompt ids our configurations ran, their result rows, and the pairwise ratios that put
every row (ours and theirs) beside a peer.

Pairwise ratio: the median over runs of (a's tok/s / b's tok/s) on the same prompt and pass;
the loop runs every configuration and peer on a prompt in turn, so the two lists line up.
Under a JSON schema (a prompt line's "json_schema") a run is `valid` when its text parses as
JSON that the schema accepts (jsonschema), and the fastest peer configuration (the highest
median tok/s) is the one every row is also put beside (`ratio_to_fastest_peer`).
"""

from __future__ import annotations

import importlib.util
import json
import statistics
import time
from dataclasses import dataclass, field, replace

from trt_spec.tools import peers as peer_registry
from trt_spec.tools.bench_output import peak_rss_mb


@dataclass
class PeerConfig:
    name: str
    peer: object  # a peer_registry.Peer, loaded
    runs: dict = field(default_factory=dict)  # workload -> list of per-run dicts
    groups: dict = field(default_factory=dict)  # workload -> list of (tokens, wall seconds)


def pairwise_ratio(runs: list[dict], baseline: list[dict]) -> float | None:
    """Median over runs of (run tok/s / baseline tok/s) on the same prompt and pass: both lists
    are in the order the interleaved loop ran them (batch 1)."""
    assert len(runs) == len(baseline), (len(runs), len(baseline))
    ratios = [r["tokens_per_s"] / b["tokens_per_s"] for r, b in zip(runs, baseline)
              if r["tokens_per_s"] and b["tokens_per_s"]]
    return statistics.median(ratios) if ratios else None


def identical_share(runs: list[dict], baseline: list[dict] | None) -> float | None:
    """The share of runs whose output equals the baseline run's on the same prompt and pass."""
    if baseline is None:
        return None
    same = [r["output_ids"] == b["output_ids"] for r, b in zip(runs, baseline)]
    return sum(same) / len(same)


def mean_of(values) -> float | None:
    """The mean of the values that are not None (None: none are)."""
    known = [float(v) for v in values if v is not None]
    return sum(known) / len(known) if known else None


def require_jsonschema() -> None:
    if importlib.util.find_spec("jsonschema") is None:
        raise ValueError("prompts with a json_schema: bench checks every answer against its "
                         "schema with jsonschema: pip install -e '.[bench]'")


def valid_json(text: str, schema: dict) -> bool:
    """Whether `text` is one JSON value that `schema` accepts."""
    import jsonschema

    try:
        jsonschema.validate(json.loads(text), schema)
    except (ValueError, jsonschema.ValidationError):  # not JSON (JSONDecodeError), or refused
        return False
    return True


def load_peers(names: list[str], ctx, skipped: dict, progress, ks: list | None = None,
               structured: bool = False) -> list[PeerConfig]:
    """Each named peer that is available and loads (a sweeping one once per k, named
    'NAME k=K' when there are several), and, where prompts carry a schema (`structured`),
    holds its output to one; the others go to `skipped` with why."""
    loaded = []
    for name in names:
        cls = peer_registry.PEERS[name]
        sweep = peer_registry.peer_ks(cls, list(ks or []))
        for k in sweep:
            label = name if len(sweep) == 1 else f"{name} k={k}"
            peer = cls()
            ok, reason = peer.available()
            if not ok:
                skipped[name] = reason
                progress(f"peer {name}: skipped ({reason})")
                break
            progress(f"peer {label}: loading (building its model once if needed) ...")
            try:
                peer.load(ctx if k is None else replace(ctx, num_draft_tokens=k))
                ok, reason = peer.holds_schemas() if structured else (True, "")
            except Exception as e:  # reported as skipped, with the reason; bench goes on
                ok, reason = False, f"load failed: {type(e).__name__}: {e}"
            if not ok:
                peer.close()
                skipped[name] = reason if reason.startswith("load failed") else (
                    f"cannot hold its output to a JSON schema: {reason}")
                progress(f"peer {name}: skipped ({skipped[name]})")
                break
            loaded.append(PeerConfig(label, peer))
    return loaded


@dataclass
class PeerRunner:
    """The loaded peers of one bench run; a peer that fails is dropped from all results and
    listed in `skipped` with the reason."""
    active: list[PeerConfig]
    skipped: dict[str, str]
    progress: object  # print-like
    decode: object  # output ids -> text (the reference engine's tokenizer)

    def run(self, p: PeerConfig, name: str, ids: list[int], max_new_tokens: int,
            temperature: float, seed: int, schema: dict | None = None) -> None:
        if p not in self.active:
            return
        t0 = time.perf_counter()
        try:
            r = p.peer.generate(ids, max_new_tokens, temperature, seed, schema)
        except Exception as e:  # reported as skipped; bench goes on with the others
            p.peer.close()
            self.active.remove(p)
            self.skipped[p.name] = f"failed while running: {type(e).__name__}: {e}"
            self.progress(f"peer {p.name}: dropped ({self.skipped[p.name]})")
            return
        wall = time.perf_counter() - t0 - r.get("untimed_s", 0.0)  # less its own checks
        if schema is not None:
            r["valid"] = valid_json(self.decode(r["output_ids"]), schema)
        p.groups.setdefault(name, []).append((r["completion_tokens"], wall))
        p.runs.setdefault(name, []).append(r)

    def close(self) -> None:
        for p in self.active:
            p.peer.close()


def summarize_peer(p: PeerConfig, workload: str, runs: list[dict], baseline: list[dict] | None,
                   ) -> dict:
    """bench's summarize() fields for a peer; what it does not report is None."""
    rates = [r["tokens_per_s"] for r in runs]
    tokens = sum(r["completion_tokens"] for r in runs)
    forwards = [r["target_forwards"] for r in runs]
    own_rss = [r["peak_rss_mb"] for r in runs if r.get("peak_rss_mb") is not None]
    return {
        "engine": p.peer.engine, "precision": p.peer.precision, "method": p.name,
        "num_draft_tokens": p.peer.num_draft_tokens, "workload": workload, "peer": True,
        "tokens_per_s": {"median": statistics.median(r for r in rates if r is not None)
                         if any(r is not None for r in rates) else None, "runs": rates},
        "throughput_tokens_per_s": (sum(t for t, _ in p.groups[workload])
                                    / sum(w for _, w in p.groups[workload])),
        "tau": tokens / sum(forwards) if None not in forwards else None,
        "completion_tokens_mean": tokens / len(runs),
        "acceptance_rate": mean_of(r.get("acceptance_rate") for r in runs),
        "acceptance_per_position": [],
        "identical_to_baseline": identical_share(runs, baseline),
        # a speculating peer's output against its own plain output (greedy; under the same
        # schema), where it says
        "identical_to_own_plain": mean_of(r.get("same_as_own_plain") for r in runs),
        # under a schema: the share of answers that parse and validate
        "valid": mean_of(r.get("valid") for r in runs),
        "valid_runs": [r.get("valid") for r in runs],  # in the order of tokens_per_s' runs
        "ttft_ms": statistics.median(r["ttft_s"] * 1000 for r in runs),
        "propose_us_per_step": None, "score_us_per_step": None, "sample_us_per_step": None,
        # a server peer reports its own process; an in-process peer shares ours
        "peak_rss_mb": max(own_rss) if own_rss else peak_rss_mb(),
    }


def peer_results(active: list[PeerConfig], ours: list, results: list[dict], ref_none,
                 workloads: list[str], temperature: float) -> None:
    """Appends a row per peer and workload to `results` (ratios against our first engine's
    none: `ref_none`), then gives every row of ours its `vs_peers` and every row its
    `ratio_to_fastest_peer`. `ours`: our configurations, each with its result row found by
    (engine, method, k, workload)."""
    for p in active:
        for name in workloads:
            baseline = ref_none.runs[name] if (ref_none and temperature == 0) else None
            r = summarize_peer(p, name, p.runs[name], baseline)
            none = ref_none.runs[name] if ref_none else None
            none_median = statistics.median(x["tokens_per_s"] for x in none) if none else None
            r["speedup_vs_none"] = (r["tokens_per_s"]["median"] / none_median
                                    if none and r["tokens_per_s"]["median"] else None)
            # peer tok/s / our none tok/s, prompt by prompt within a pass, then the median
            r["ratio_pairwise"] = pairwise_ratio(p.runs[name], none) if none else None
            results.append(r)
    if not active:
        return
    runs_of = {}  # id(row) -> its runs
    for c in ours:  # ours / peer, pair by pair, for every configuration of ours
        for name in workloads:
            r = next(x for x in results if x["engine"] == c.engine and x["workload"] == name
                     and x["method"] == c.method and x["num_draft_tokens"] == c.k
                     and not x.get("peer"))
            r["vs_peers"] = {p.name: pairwise_ratio(c.runs[name], p.runs[name])
                             for p in active}
            runs_of[id(r)] = c.runs[name]
    for p in active:
        for r in results:
            if r.get("peer") and r["method"] == p.name:
                runs_of[id(r)] = p.runs[r["workload"]]
    for name in workloads:
        fastest = max(active, key=lambda p: statistics.median(
            [x["tokens_per_s"] or 0.0 for x in p.runs[name]]))
        for r in results:
            if r["workload"] == name and id(r) in runs_of:
                r["fastest_peer"] = fastest.name
                r["ratio_to_fastest_peer"] = pairwise_ratio(runs_of[id(r)],
                                                            fastest.runs[name])
