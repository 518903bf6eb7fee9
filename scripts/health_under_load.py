"""/health's latency while `trt-spec serve` answers the largest response it allows.

Starts a server on ENGINE (or uses --url), then sends one /v1/completions request as large
as the response-size bound lets it be (serve/endpoint.py MAX_RESPONSE_VALUES: prompts x
tokens x (alternatives + 1) x n log-probability values; echo with logprobs 20, long prompts
of token ids), and polls /health every --interval-ms until the answer is in. Prints the
request's size and time and /health's latency (median, p99, max), and the same figures
with no load for comparison; exits 1 when the slowest /health passed --bound-ms.

    python scripts/health_under_load.py --engine engines/smollm2-135m --bound-ms 100
"""

from __future__ import annotations

import argparse
import json
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from load import free_port, wait_healthy  # noqa: E402

from trt_spec.serve.endpoint import MAX_RESPONSE_VALUES  # noqa: E402


def largest_request(model: str, max_len: int, vocab: int, n: int = 1,
                    prompts: int = 64, top: int = 20) -> tuple[dict, int]:
    """The largest completions request within the bound: `prompts` token-id prompts, each as
    long as the bound and the context allow (max_tokens 1), echoed with `top` logprobs.
    Returns it and its values (the server's estimate)."""
    per_token = (top + 1) * n * prompts
    # the prompts' values and the output's (max_tokens 1, logprobs `top`) within the bound
    tokens = min(max_len - 1, (MAX_RESPONSE_VALUES - per_token) // per_token)
    ids = [[3 + (7 * i + j) % (vocab - 3) for j in range(tokens)] for i in range(prompts)]
    body = {"model": model, "prompt": ids, "max_tokens": 1, "echo": True, "logprobs": top,
            "n": n, "temperature": 0}
    return body, (tokens + 1) * per_token


def poll_health(url: str, interval_s: float, stop: threading.Event) -> list[float]:
    """/health latencies (s), one every interval_s until `stop`."""
    out = []
    with httpx.Client(timeout=60) as client:
        while not stop.is_set():
            t0 = time.perf_counter()
            client.get(f"{url}/health").raise_for_status()
            out.append(time.perf_counter() - t0)
            time.sleep(interval_s)
    return out


def measure(url: str, body: dict, interval_s: float = 0.02) -> dict:
    """Sends `body` while polling /health. The request's status, size (bytes) and seconds,
    and /health's latencies (ms) during it and in an idle second before."""
    def figures(xs: list[float]) -> dict:
        xs = sorted(x * 1000 for x in xs)
        return {"n": len(xs), "median_ms": statistics.median(xs),
                "p99_ms": xs[min(len(xs) - 1, int(len(xs) * 0.99))], "max_ms": xs[-1]}

    idle = threading.Event()
    timer = threading.Timer(1.0, idle.set)
    timer.start()
    before = poll_health(url, interval_s, idle)
    stop, during = threading.Event(), []
    poller = threading.Thread(target=lambda: during.extend(poll_health(url, interval_s, stop)))
    poller.start()
    t0 = time.perf_counter()
    try:
        r = httpx.post(f"{url}/v1/completions", json=body, timeout=600)
    finally:
        took = time.perf_counter() - t0
        stop.set()
        poller.join()
    return {"status": r.status_code, "response_bytes": len(r.content), "request_s": took,
            "health_idle": figures(before), "health_during": figures(during)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engine", default="engines/smollm2-135m")
    ap.add_argument("--url", help="a running server's (its model: --model); else one starts")
    ap.add_argument("--model", default="health")
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--n", type=int, default=1)
    ap.add_argument("--interval-ms", type=float, default=20)
    ap.add_argument("--bound-ms", type=float, default=100)
    ap.add_argument("--json", dest="json_out", default="health_under_load.json")
    args = ap.parse_args(argv)
    proc = None
    url = args.url
    if url is None:
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        proc = subprocess.Popen([sys.executable, "-m", "trt_spec.cli", "serve", "--engine",
                                 args.engine, "--port", str(port), "--served-model-name",
                                 args.model, "--max-model-len", str(args.max_model_len),
                                 "--max-waiting", str(max(64, args.prompts * args.n))])
    try:
        if proc is not None:
            wait_healthy(url, proc)
        info = httpx.get(f"{url}/tokenizer_info", timeout=10).json()
        body, values = largest_request(args.model, info["model_max_length"],
                                       info["vocab_size"], args.n, args.prompts)
        report = {"values": values, "bound": MAX_RESPONSE_VALUES, "prompts": args.prompts,
                  "prompt_tokens": len(body["prompt"][0]), "n": args.n,
                  **measure(url, body, args.interval_ms / 1000)}
    finally:
        if proc is not None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(60)
    worst = report["health_during"]["max_ms"]
    report["passed"] = report["status"] == 200 and worst <= args.bound_ms
    Path(args.json_out).write_text(json.dumps(report, indent=2) + "\n")
    d, i = report["health_during"], report["health_idle"]
    print(f"request: {args.prompts} prompts x {report['prompt_tokens']} tokens, n {args.n}, "
          f"echo with logprobs 20: {values:,} values (bound {MAX_RESPONSE_VALUES:,}); status "
          f"{report['status']}, {report['response_bytes'] / 1e6:.1f} MB in "
          f"{report['request_s']:.1f} s\n"
          f"/health idle:   median {i['median_ms']:.1f} ms, p99 {i['p99_ms']:.1f}, max "
          f"{i['max_ms']:.1f} ({i['n']} polls)\n"
          f"/health during: median {d['median_ms']:.1f} ms, p99 {d['p99_ms']:.1f}, max "
          f"{d['max_ms']:.1f} ({d['n']} polls); bound {args.bound_ms:g} ms\n"
          f"{'PASS' if report['passed'] else 'FAIL'}; report: {args.json_out}")
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
