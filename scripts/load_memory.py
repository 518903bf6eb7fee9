"""What the load test (scripts/load.py) reads of a server's memory: its processes' RSS, and
the fill of its bounded caches, which the warm-up waits for before the RSS baseline (memory
that grows while a bounded cache fills is not a leak)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Callable

import httpx


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def metric_values(url: str, name: str) -> float:
    """The sum of one metric's samples on url's /metrics (0 when absent)."""
    total = 0.0
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            total += float(line.rsplit(" ", 1)[1])
    return total


def warm_up(run_round: Callable[[int], list[dict]], metrics_urls: Callable[[], list[str]],
            limit_s: float) -> tuple[list[dict], float]:
    """Rounds of requests (run_round(requests so far) -> their results) until every server's
    suffix lookup cache is full (90% of its bound; a server that made none has nothing to
    fill), or limit_s seconds. metrics_urls(): each server's /metrics (the Ray replicas').
    -> (the requests' results, seconds)."""
    t0, results = time.perf_counter(), []
    while True:
        results += run_round(len(results))
        fills = [(metric_values(u, "trt_spec:suffix_cache_tokens"),
                  metric_values(u, "trt_spec:suffix_cache_max_tokens")) for u in metrics_urls()]
        took = time.perf_counter() - t0
        print(f"warm-up: {len(results)} requests, {took:.0f} s; suffix cache "
              + ", ".join(f"{held:.0f} of {bound:.0f} tokens" for held, bound in fills),
              flush=True)
        if all(held >= 0.9 * bound for held, bound in fills) or took >= limit_s:
            return results, took
