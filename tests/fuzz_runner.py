"""Sends the fuzzer's requests (tests/fuzz_strategies.py) and keeps the tally.

`fuzz(client, examples, seed)` draws `examples` calls with Hypothesis (a fixed seed: the same
calls every run), sends each through `client` (an httpx.Client on a real server's URL, or
Starlette's TestClient on the app in process: the same interface), and returns a Tally:
statuses by route, every failure (`verdict`, a timeout or a dropped connection: a hang or a
crash), and every request slower than SLOW_S. It never raises on a bad response: a run
reports every failure it meets, not the first one shrunk (tests/test_fuzz_server.py's
per-route tests shrink). Without a strategy it sends each route's in turn (ROUTES), by its
share in WEIGHTS.

`campaign(url, examples)` is the whole check on a real server: a greedy victim before and
after, a greedy victim stream in a loop beside the fuzzed calls, /health probed beside them,
the server's log read for tracebacks and its RSS compared.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from dataclasses import dataclass, field

import httpx
from hypothesis import HealthCheck, Phase, given, seed, settings

from tests.fuzz_strategies import ROUTES, WEIGHTS, Call, verdict, victim_body

SLOW_S = 1.0  # a request slower than this is noted (the tiny model answers in milliseconds)
TIMEOUT_S = 30.0  # one past this is a hang
HEALTH_EVERY_S = 0.2


@dataclass
class Tally:
    statuses: Counter = field(default_factory=Counter)  # (route, status) -> count
    failures: list = field(default_factory=list)  # (call, what went wrong)
    slow: list = field(default_factory=list)  # (seconds, call)
    seconds: float = 0.0

    @property
    def requests(self) -> int:
        return sum(self.statuses.values())

    def by_status(self) -> Counter:
        out = Counter()
        for (_, status), n in self.statuses.items():
            out[status] += n
        return out

    def by_route(self) -> dict[str, Counter]:
        out: dict[str, Counter] = {}
        for (route, status), n in self.statuses.items():
            out.setdefault(route, Counter())[status] += n
        return out


def send(client: httpx.Client, call: Call, tally: Tally) -> None:
    """One call, its status and any failure recorded in `tally` (the client's timeout: a
    hang)."""
    t0 = time.perf_counter()
    try:
        r = client.request(call.method, call.path, content=call.body,
                           headers={"Content-Type": "application/json"} if call.body is not None
                           else None)
        status, problem = r.status_code, verdict(r.status_code, r.text)
    except httpx.TimeoutException:
        status, problem = "timeout", f"no answer within {client.timeout}"
    except httpx.TransportError as e:
        status, problem = "dropped", f"{type(e).__name__}: {e}"
    took = time.perf_counter() - t0
    tally.statuses[(call.route, status)] += 1
    if problem:
        tally.failures.append((call, problem))
    if took > SLOW_S:
        tally.slow.append((round(took, 2), call))


def fuzz(client: httpx.Client, examples: int, seed_: int = 0, strategy=None,
         tally: Tally | None = None, weights: dict = WEIGHTS) -> Tally:
    """`examples` calls drawn from `strategy` with seed `seed_`, sent one after another;
    without a strategy, from each route's (ROUTES) in turn, by its share in `weights` (one
    strategy over all the routes draws the deep values of each less often)."""
    tally = tally or Tally()
    if strategy is None:
        total, start = sum(weights.values()), tally.requests
        for i, (name, weight) in enumerate(weights.items()):
            last = i == len(weights) - 1
            share = examples - (tally.requests - start) if last else examples * weight // total
            if share > 0:
                fuzz(client, share, seed_, ROUTES[name], tally)
        return tally

    @seed(seed_)
    @settings(max_examples=examples, phases=[Phase.generate], database=None, deadline=None,
              suppress_health_check=list(HealthCheck))
    @given(call=strategy)
    def run(call):
        send(client, call, tally)

    t0 = time.perf_counter()
    run()
    tally.seconds += time.perf_counter() - t0
    return tally


def greedy(client: httpx.Client, body: dict) -> str:
    """The victim's text (a stream's deltas joined): what must not change."""
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    if not body.get("stream"):
        return r.json()["choices"][0]["text"]
    parts = [json.loads(line[6:]) for line in r.text.splitlines()
             if line.startswith("data: {")]
    errors = [p["error"] for p in parts if "error" in p]
    assert not errors, f"the victim stream ended with an error event: {errors}"
    return "".join(p["choices"][0]["text"] for p in parts if p.get("choices"))


@dataclass
class Campaign:
    """A fuzzing run against a real server, and what it did to the server."""

    tally: Tally
    victim: str  # the greedy victim's text before the run
    victim_after: str
    stream_runs: int  # victim streams run beside the fuzzed requests
    stream_problems: list  # each a stream that failed or whose text differed
    health_s: float  # /health's latency after the run
    health_status: int
    health_max_s: float  # /health's slowest answer during the run (probed every 0.2 s)
    tracebacks: list  # log lines: "Traceback" and the exception line that ends each
    rss_mb: tuple[float, float] | None  # the server's RSS before and after

    @property
    def failures(self) -> list[str]:
        out = [f"{call.route}: {problem} <- {call!r}" for call, problem in self.tally.failures]
        out += [f"victim stream: {p}" for p in self.stream_problems]
        out += [f"log: {line}" for line in self.tracebacks]
        if self.victim_after != self.victim:
            out.append(f"victim changed: {self.victim!r} -> {self.victim_after!r}")
        if self.health_status != 200:
            out.append(f"/health answered {self.health_status} after the run")
        return out


def campaign(url: str, examples: int, seed_: int = 0, log_path=None, pid: int | None = None,
             strategy=None, weights: dict = WEIGHTS) -> Campaign:
    """The greedy victim answered, then `examples` fuzzed calls with a victim stream running
    beside them in a loop, then the victim again, /health, the server's log (log_path: its
    stderr) read for tracebacks and its RSS (pid) compared."""
    import threading

    with httpx.Client(base_url=url, timeout=TIMEOUT_S) as client:
        rss0 = rss_mb(pid)
        victim = greedy(client, victim_body())
        streamed = greedy(client, victim_body(stream=True))
        stop, runs, problems = threading.Event(), [0], []

        def stream_beside():
            with httpx.Client(base_url=url, timeout=TIMEOUT_S) as own:
                while not stop.is_set():
                    try:
                        got = greedy(own, victim_body(stream=True))
                        if got != streamed:
                            problems.append(f"{got!r} instead of {streamed!r}")
                    except (AssertionError, httpx.HTTPError) as e:
                        problems.append(f"{type(e).__name__}: {str(e)[:300]}")
                    runs[0] += 1

        health_during = [0.0]

        def probe_health():
            with httpx.Client(base_url=url, timeout=TIMEOUT_S) as own:
                while not stop.wait(HEALTH_EVERY_S):
                    t0 = time.perf_counter()
                    own.get("/health")
                    health_during[0] = max(health_during[0], time.perf_counter() - t0)

        beside = [threading.Thread(target=f, daemon=True) for f in (stream_beside, probe_health)]
        for thread in beside:
            thread.start()
        try:
            tally = fuzz(client, examples, seed_, strategy, weights=weights)
        finally:
            stop.set()
            for thread in beside:
                thread.join(TIMEOUT_S)
        after = greedy(client, victim_body())
        t0 = time.perf_counter()
        health = client.get("/health").status_code
        health_s = time.perf_counter() - t0
        rss1 = rss_mb(pid)
    return Campaign(tally, victim, after, runs[0], problems, health_s, health, health_during[0],
                    tracebacks(log_path), None if rss0 is None else (rss0, rss1))


def tracebacks(log_path) -> list[str]:
    """The log's tracebacks (each as its last line, the exception) and ERROR lines."""
    if log_path is None:
        return []
    lines = open(log_path, encoding="utf-8", errors="replace").read().splitlines()
    out = []
    for i, line in enumerate(lines):
        if line.startswith("Traceback"):
            end = next((j for j in range(i + 1, len(lines))
                        if lines[j] and not lines[j].startswith((" ", "\t"))), i)
            out.append(f"Traceback ... {lines[end][:300]}")
        elif "ERROR" in line or "Exception in ASGI" in line:
            out.append(line[:300])
    return out


def rss_mb(pid: int | None) -> float | None:
    if pid is None:
        return None
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return None
