"""Bounded load test of `trt-spec serve` (`make load`).

Starts a server on ENGINE at 127.0.0.1 (a free port), warms it up (one request per client,
then more rounds until the server's bounded caches are full: the suffix lookups' cache of
ended requests, whose memory grows with it up to its bound; at most --warmup-limit seconds),
reads its RSS, then runs N streaming chat clients back to back for T seconds (each request
started before the deadline runs to its end), reads the RSS again and stops the server with
SIGTERM. Prints requests/s, generated tokens/s, latency and time-to-first-token p50/p99,
errors and the RSS change, and writes the same as JSON. Exits 1 when a request failed or the
RSS grew past --rss-bound-mb.

    python scripts/load.py --engine engines/smollm2-135m --clients 16 --duration 120
    python scripts/load.py --engine engines/smollm2-135m --clients 4 --long-prompt 2000 \
        -- --max-prefill-tokens 128

With --long-prompt N, the clients instead keep long streams decoding while one prompt of N
tokens arrives: it reports the gaps between the tokens of those streams while the prompt is
read (longest, p99, median) and the long prompt's time to first token (chunked prefill).
    python scripts/load.py --engine engines/smollm2-135m -- --ray --replicas 2 --threads 1

With --compare-plain the same workload runs with the server's speculation and, per request,
without it (`"speculative": {"method": "none"}`), `--rounds` times each, alternated, at each
--concurrency (default 1, 2, 4, 8): throughput and p50/p99 time per output token side by side.
Both modes of a round send the same requests (numbered across clients, prompt i of the list
mod its length); the next round goes on down the list. A list shorter than the run recurs,
and then the server's suffix cache finds earlier answers to the same prompt (greedy: whole).
    python scripts/load.py --compare-plain --temperature 0 --duration 30 -- --method hybrid

With `--ray` among the server options the server is `trt-spec serve --ray` (Ray Serve
replicas behind one endpoint); the RSS is then the sum over the replica processes (from the
metrics targets file the server keeps), the driver's not counted.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from load_memory import rss_mb, warm_up  # noqa: E402  (scripts/ sits beside this file)

PROMPTS = [json.loads(line) for line in
           (Path(__file__).resolve().parents[1] / "runtime" / "data" / "prompts.jsonl")
           .read_text().splitlines() if line.strip()]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    v = sorted(values)
    return v[min(len(v) - 1, int(q / 100 * len(v)))]


def messages(i: int, unique: bool = False) -> list[dict]:
    """Request i's chat. unique: its first message starts with the request number, so no two
    requests share more than the chat template's opening (a single-turn workload that a
    prefix cache cannot help)."""
    p = PROMPTS[i % len(PROMPTS)]
    msgs = p["messages"] if "messages" in p else [{"role": "user", "content": p["prompt"]}]
    if unique:
        msgs = [{**msgs[0], "content": f"Request {i}. {msgs[0]['content']}"}, *msgs[1:]]
    return msgs


async def one_request(client: httpx.AsyncClient, url: str, model: str, i: int, args,
                      extra: dict | None = None) -> dict:
    """One streaming chat completion; returns its latency, TTFT and token count, or error.
    As clients send it: sampled requests carry no seed unless --seeded (a seeded request
    is exempt from the speculation policy's gain rules). extra: more body fields."""
    body = {"model": model, "messages": messages(i, args.unique), "max_tokens": args.max_tokens,
            "temperature": args.temperature, "stream": True,
            "stream_options": {"include_usage": True}, **(extra or {})}
    if args.seeded:
        body["seed"] = i
    t0 = time.perf_counter()
    ttft, usage, done = None, None, False
    try:
        async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                return {"error": f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"}
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    done = True
                    break
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    return {"error": chunk["error"]["message"]}
                delta = chunk["choices"][0]["delta"] if chunk["choices"] else {}
                if ttft is None and delta.get("content"):
                    ttft = time.perf_counter() - t0
                usage = chunk.get("usage") or usage
    except httpx.HTTPError as e:
        return {"error": f"{type(e).__name__}: {e}"}
    if not done or usage is None:
        return {"error": "the stream ended without usage and [DONE]"}
    return {"latency": time.perf_counter() - t0, "ttft": ttft,
            "tokens": usage["completion_tokens"]}


async def run_clients(url: str, model: str, args, duration: float, clients: int | None = None,
                      extra: dict | None = None, start: int = 0) -> list[dict]:
    """Requests start, start + 1, ... in the order the clients send them (one numbering for
    all clients: no two send the same prompt at once, as clients of one prompt list each
    starting at its head would)."""
    deadline = time.perf_counter() + duration
    results: list[dict] = []
    numbers = itertools.count(start)

    async def client_loop(c: int):
        n = 0
        async with httpx.AsyncClient(timeout=args.request_timeout) as client:
            while n == 0 or time.perf_counter() < deadline:  # at least one (the warm-up)
                results.append(await one_request(client, url, model, next(numbers), args,
                                                 extra))
                n += 1

    await asyncio.gather(*(client_loop(c) for c in range(clients or args.clients)))
    return results


def time_per_output_token(r: dict) -> float | None:
    """Seconds per output token after the first (the decode pace a client sees)."""
    if r.get("ttft") is None or r["tokens"] < 2:
        return None
    return (r["latency"] - r["ttft"]) / (r["tokens"] - 1)


PLAIN = {"speculative": {"method": "none"}}  # the per-request field: no drafting


def phase(results: list[dict], elapsed: float) -> dict:
    good = [r for r in results if "error" not in r]
    tpots = [t for t in map(time_per_output_token, good) if t is not None]
    tokens = sum(r["tokens"] for r in good)
    return {"requests": len(good), "errors": len(results) - len(good),
            "error_samples": [r["error"] for r in results if "error" in r][:3],
            "tokens": tokens, "elapsed_s": elapsed, "tokens_per_s": tokens / elapsed,
            "tpot_s": {"p50": percentile(tpots, 50), "p99": percentile(tpots, 99)}}


def compare_plain(url: str, model: str, args) -> dict:
    """At each concurrency: the same workload with the server's speculation and with none (the
    per-request `speculative` field), `--rounds` times, the order alternated so drift hits both
    alike -> per concurrency and mode: throughput and time per output token."""
    levels = []
    start = max(args.concurrency)  # past the warm-up's requests
    for c in args.concurrency:
        runs: dict[str, list[dict]] = {"speculative": [], "plain": []}
        for r in range(args.rounds):
            order = ("speculative", "plain") if (r + len(levels)) % 2 == 0 else ("plain",
                                                                                 "speculative")
            sent = 0
            for mode in order:  # both modes send the same requests; the next round goes on
                t0 = time.perf_counter()
                results = asyncio.run(run_clients(url, model, args, args.duration, c,
                                                  PLAIN if mode == "plain" else None, start))
                runs[mode].append(phase(results, time.perf_counter() - t0))
                sent = max(sent, len(results))
                print(f"concurrency {c}, {mode}: {runs[mode][-1]['tokens_per_s']:.1f} tok/s",
                      file=sys.stderr)
            start += sent
        level = {"concurrency": c}
        for mode, phases in runs.items():
            tokens = sum(p["tokens"] for p in phases)
            elapsed = sum(p["elapsed_s"] for p in phases)
            tpots = [p["tpot_s"]["p50"] for p in phases if p["tpot_s"]["p50"] is not None]
            p99s = [p["tpot_s"]["p99"] for p in phases if p["tpot_s"]["p99"] is not None]
            level[mode] = {"tokens_per_s": tokens / elapsed,
                           "tpot_p50_s": statistics.median(tpots) if tpots else None,
                           "tpot_p99_s": max(p99s) if p99s else None,
                           "requests": sum(p["requests"] for p in phases),
                           "errors": sum(p["errors"] for p in phases),
                           "error_samples": [e for p in phases for e in p["error_samples"]][:3],
                           "phases": phases}
        level["throughput_ratio"] = (level["speculative"]["tokens_per_s"]
                                     / level["plain"]["tokens_per_s"])
        levels.append(level)
    return {"levels": levels}


def compare_table(levels: list[dict]) -> str:
    def ms(x):
        return "n/a" if x is None else f"{1000 * x:.1f}"

    lines = ["clients  spec tok/s  plain tok/s  ratio  TPOT p50 spec/plain ms  "
             "TPOT p99 spec/plain ms",
             "-" * 88]
    for lv in levels:
        s, p = lv["speculative"], lv["plain"]
        lines.append(f"{lv['concurrency']:7d}  {s['tokens_per_s']:10.1f}  "
                     f"{p['tokens_per_s']:11.1f}  {lv['throughput_ratio']:5.2f}  "
                     f"{ms(s['tpot_p50_s']):>11} / {ms(p['tpot_p50_s']):<11}  "
                     f"{ms(s['tpot_p99_s']):>9} / {ms(p['tpot_p99_s'])}")
    return "\n".join(lines)


async def long_prompt_run(url: str, model: str, args) -> dict:
    """`clients` streams decoding (ignore_eos, long max_tokens); after they run 3 s, one
    prompt of args.long_prompt tokens (ids, so the count is exact) arrives. Returns the gaps
    between content chunks of the decoding streams and the long prompt's TTFT."""
    arrivals: list[list[float]] = [[] for _ in range(args.clients)]
    stop = asyncio.Event()

    async def decoding(c: int, client: httpx.AsyncClient):
        body = {"model": model, "messages": messages(c), "max_tokens": 1500, "temperature": 0,
                "ignore_eos": True, "stream": True}
        while not stop.is_set():
            async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
                async for line in r.aiter_lines():
                    if stop.is_set():
                        return
                    if line.startswith("data: {") and '"content"' in line:
                        arrivals[c].append(time.perf_counter())

    async with httpx.AsyncClient(timeout=args.request_timeout) as client:
        tasks = [asyncio.create_task(decoding(c, client)) for c in range(args.clients)]
        await asyncio.sleep(3)
        ids = [(i * 7919) % 20000 + 100 for i in range(args.long_prompt)]
        body = {"model": model, "prompt": ids, "max_tokens": 8, "temperature": 0,
                "stream": True}
        t_sent = time.perf_counter()
        t_first = None
        async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
            if r.status_code != 200:
                raise RuntimeError(f"the long prompt got HTTP {r.status_code}: "
                                   f"{(await r.aread())[:300]!r}")
            async for line in r.aiter_lines():
                if t_first is None and line.startswith("data: {"):
                    t_first = time.perf_counter()
        await asyncio.sleep(2)
        stop.set()
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    gaps_all, gaps_window = [], []
    for times in arrivals:
        for a, b in zip(times, times[1:]):
            gaps_all.append(b - a)
            if t_sent <= b <= t_first + 0.5:  # gaps that end while the prompt is read
                gaps_window.append(b - a)
    median = percentile(gaps_all, 50)
    p99 = percentile(gaps_window, 99)
    return {"long_prompt_tokens": args.long_prompt, "decoding_streams": args.clients,
            "long_prompt_ttft_s": t_first - t_sent,
            "gaps_while_reading_s": {"count": len(gaps_window), "max": max(gaps_window),
                                     "p99": p99, "p50": percentile(gaps_window, 50)},
            "gaps_all_s": {"count": len(gaps_all), "max": max(gaps_all), "p50": median,
                           "p99": percentile(gaps_all, 99)},
            "p99_over_median": p99 / median}


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float = 120) -> None:
    t0 = time.time()
    while time.time() - t0 < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}")
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"the server at {url} was not healthy after {timeout} s")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engine", default="engines/smollm2-135m")
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--duration", type=float, default=120, help="seconds of load")
    ap.add_argument("--max-tokens", type=int, default=64, help="per request")
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--request-timeout", type=float, default=300)
    ap.add_argument("--rss-bound-mb", type=float, default=64,
                    help="largest allowed RSS growth from after warm-up to the end")
    ap.add_argument("--warmup-limit", type=float, default=300,
                    help="seconds of warm-up at most while the server's caches fill")
    ap.add_argument("--long-prompt", type=int, default=None, metavar="TOKENS",
                    help="measure the decoding streams' pace while a prompt of TOKENS arrives")
    ap.add_argument("--prompts", type=Path, default=None,
                    help="JSON lines of {prompt} or {messages} [default: runtime/data/prompts.jsonl]")
    ap.add_argument("--unique", action="store_true",
                    help="number each request's prompt: no two share a prefix past the template")
    ap.add_argument("--seeded", action="store_true",
                    help="give every request a seed (clients rarely do; a seeded sampled "
                         "request always drafts its k)")
    ap.add_argument("--compare-plain", action="store_true",
                    help="the same workload with the server's speculation and without it (the "
                         "per-request `speculative` field), side by side per --concurrency")
    ap.add_argument("--concurrency", default="1,2,4,8",
                    help="--compare-plain: clients at a time, comma-separated [default: 1,2,4,8]")
    ap.add_argument("--rounds", type=int, default=2,
                    help="--compare-plain: runs of each mode per concurrency, alternated")
    ap.add_argument("--json", dest="json_out", default="load.json")
    ap.add_argument("server_args", nargs="*", help="extra `trt-spec serve` options (after --)")
    args = ap.parse_args(argv)
    if args.clients < 1 or args.duration <= 0:
        ap.error("--clients must be >= 1 and --duration > 0")
    try:
        args.concurrency = [int(x) for x in args.concurrency.split(",") if x.strip()]
    except ValueError:
        ap.error(f"--concurrency {args.concurrency!r}: expected comma-separated integers")
    if not args.concurrency or min(args.concurrency) < 1 or args.rounds < 1:
        ap.error("--concurrency needs integers >= 1 and --rounds >= 1")
    if args.prompts is not None:
        PROMPTS[:] = [json.loads(line) for line in args.prompts.read_text().splitlines()
                      if line.strip()]

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    model = "load-test"
    cmd = [sys.executable, "-m", "trt_spec.cli", "serve", "--engine", args.engine, "--port",
           str(port), "--served-model-name", model, *args.server_args]
    load_before = os.getloadavg()[0]  # the machine may be shared: say how busy it was
    targets = None
    if "--ray" in args.server_args:
        targets = Path(args.json_out).with_suffix(".targets.json")
        cmd += ["--metrics-targets", str(targets)]
    proc = subprocess.Popen(cmd)

    def replicas() -> list[dict]:
        """The Ray replicas in the targets file (the driver writes it once every one is up)."""
        for _ in range(50):
            if targets.is_file():
                break
            time.sleep(0.2)
        return json.loads(targets.read_text())

    def server_rss() -> float:
        if targets is None:
            return rss_mb(proc.pid)
        return sum(rss_mb(int(t["labels"]["pid"])) for t in replicas())

    if args.compare_plain:
        try:
            wait_healthy(url, proc)
            asyncio.run(run_clients(url, model, args, 0, max(args.concurrency)))  # warm-up
            asyncio.run(run_clients(url, model, args, 0, max(args.concurrency), PLAIN))
            report = compare_plain(url, model, args)
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(60)
        report["settings"] = {"engine": args.engine, "duration_s": args.duration,
                              "rounds": args.rounds, "max_tokens": args.max_tokens,
                              "temperature": args.temperature, "seeded": args.seeded,
                              "server_args": args.server_args}
        report["machine"] = {"cpus": os.cpu_count(), "platform": platform.platform(),
                             "load_average_1min": {"before": load_before,
                                                   "after": os.getloadavg()[0]}}
        errors = sum(lv[m]["errors"] for lv in report["levels"]
                     for m in ("speculative", "plain"))
        report["passed"] = errors == 0
        Path(args.json_out).write_text(json.dumps(report, indent=2) + "\n")
        print(f"{args.engine}, {' '.join(args.server_args) or 'default options'} against "
              f"method none per request (max_tokens {args.max_tokens}, temperature "
              f"{args.temperature}, {args.rounds} x {args.duration:g} s per mode)\n"
              + compare_table(report["levels"])
              + f"\nmachine load average {load_before:.2f} before, {os.getloadavg()[0]:.2f} "
              f"after\n{'PASS' if report['passed'] else 'FAIL'} ({errors} errors); report: "
              f"{args.json_out}")
        return 0 if report["passed"] else 1
    if args.long_prompt:
        try:
            wait_healthy(url, proc)
            asyncio.run(run_clients(url, model, args, 0))  # warm-up
            report = asyncio.run(long_prompt_run(url, model, args))
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(60)
        report["server_args"] = args.server_args
        report["load_average_1min"] = {"before": load_before, "after": os.getloadavg()[0]}
        g, w = report["gaps_all_s"], report["gaps_while_reading_s"]
        report["passed"] = w["max"] < 1.0 and report["p99_over_median"] <= 5
        Path(args.json_out).write_text(json.dumps(report, indent=2) + "\n")
        print(f"{args.clients} streams decoding, a {args.long_prompt}-token prompt arrives "
              f"({' '.join(args.server_args) or 'default options'})\n"
              f"gaps while it is read: {w['count']}, longest {w['max']:.3f} s, p99 "
              f"{w['p99']:.3f} s, p50 {w['p50']:.3f} s\n"
              f"gaps over the run:     median {g['p50']:.3f} s; p99 while read / median "
              f"{report['p99_over_median']:.1f}\n"
              f"long prompt's time to first token {report['long_prompt_ttft_s']:.2f} s\n"
              f"machine load average {load_before:.2f} before, {os.getloadavg()[0]:.2f} after\n"
              f"{'PASS' if report['passed'] else 'FAIL'} (longest < 1 s, p99 <= 5x median); "
              f"report: {args.json_out}")
        return 0 if report["passed"] else 1
    def metrics_urls() -> list[str]:
        if targets is None:
            return [url]
        return [f"http://{t['targets'][0]}" for t in replicas()]

    try:
        wait_healthy(url, proc)
        rss_start = server_rss()
        warm, warm_s = warm_up(
            lambda done: asyncio.run(run_clients(url, model, args, 0, start=done)),
            metrics_urls, args.warmup_limit)
        rss_before = server_rss()
        t0 = time.perf_counter()
        results = asyncio.run(run_clients(url, model, args, args.duration))
        elapsed = time.perf_counter() - t0
        rss_after = server_rss()
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            exit_code = proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            exit_code = proc.wait()

    good = [r for r in results if "error" not in r]
    errors = [r["error"] for r in results + warm if "error" in r]
    latencies = [r["latency"] for r in good]
    ttfts = [r["ttft"] for r in good if r["ttft"] is not None]
    tokens = sum(r["tokens"] for r in good)
    report = {
        "settings": {"engine": args.engine, "clients": args.clients, "duration_s": args.duration,
                     "max_tokens": args.max_tokens, "temperature": args.temperature,
                     "server_args": args.server_args},
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                    "load_average_1min": {"before": load_before, "after": os.getloadavg()[0]}},
        "elapsed_s": elapsed,
        "warmup": {"requests": len(warm), "seconds": warm_s},
        "requests": len(good),
        "errors": len(errors),
        "error_samples": errors[:5],
        "requests_per_s": len(good) / elapsed,
        "generated_tokens": tokens,
        "tokens_per_s": tokens / elapsed,
        "latency_s": {"p50": percentile(latencies, 50), "p99": percentile(latencies, 99)},
        "ttft_s": {"p50": percentile(ttfts, 50), "p99": percentile(ttfts, 99)},
        "rss_mb": {"start": rss_start, "warmup_growth": rss_before - rss_start,
                   "before": rss_before, "after": rss_after, "growth": rss_after - rss_before,
                   "bound": args.rss_bound_mb,
                   "of": "the server" if targets is None else "the Ray Serve replicas, summed"},
        "server_exit_code": exit_code,
    }
    report["passed"] = (not errors and report["requests"] > 0
                        and report["rss_mb"]["growth"] <= args.rss_bound_mb and exit_code == 0)
    Path(args.json_out).write_text(json.dumps(report, indent=2) + "\n")
    lat, ttft, rss = report["latency_s"], report["ttft_s"], report["rss_mb"]

    def fmt(x):
        return "n/a" if x is None else f"{x:.3f}"

    print(f"{args.clients} clients x {args.duration:g} s on {args.engine} "
          f"(max_tokens {args.max_tokens}, temperature {args.temperature})\n"
          f"requests   {report['requests']} ({report['requests_per_s']:.2f}/s), "
          f"errors {report['errors']}\n"
          f"tokens     {tokens} generated ({report['tokens_per_s']:.1f}/s)\n"
          f"latency    p50 {fmt(lat['p50'])} s, p99 {fmt(lat['p99'])} s\n"
          f"first tok  p50 {fmt(ttft['p50'])} s, p99 {fmt(ttft['p99'])} s\n"
          f"server RSS {rss['before']:.0f} MB -> {rss['after']:.0f} MB "
          f"({rss['growth']:+.1f} MB; bound {args.rss_bound_mb:g} MB); at start "
          f"{rss['start']:.0f} MB, {rss['warmup_growth']:+.0f} MB while the caches filled\n"
          f"server exit code {exit_code} (SIGTERM); machine load average "
          f"{load_before:.2f} before, {os.getloadavg()[0]:.2f} after\n"
          f"{'PASS' if report['passed'] else 'FAIL'}; report: {args.json_out}")
    for e in errors[:5]:
        print(f"  error: {e}", file=sys.stderr)
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
