"""Hostile requests against `trt-spec serve`, and the server's memory afterwards.

Starts a server on ENGINE, warms it up (good requests, then --warm-up-rounds hostile rounds:
the preallocated KV cache's pages and ONNX Runtime's arenas reach the sizes the measured
rounds need; measured here, RSS stops growing after about 10), reads its RSS, then sends
ROUNDS rounds of malformed, oversized and abusive requests (bodies at and past the size
limit, JSON nested past the parser, wrong types, negative seeds, integers of 5,000 digits,
ids outside the vocabulary, template variables that collide with the renderer's own, JSON
text nested past the parser, a regex no text matches, a large echo with logprobs, prompts
far past the context, streams dropped mid-way, bursts past the queue), reads the RSS again
and stops it.
Prints every status seen and the RSS change; exits 1 on any 5xx or an RSS growth past
--rss-bound-mb.

    python scripts/hostile.py --engine engines/smollm2-135m --rounds 50
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from load import free_port, rss_mb, wait_healthy  # noqa: E402

LIMIT = 1 << 20  # the server's default --max-body-bytes


def bodies(model: str) -> list[tuple[str, bytes]]:
    good = {"model": model, "prompt": "Hello", "max_tokens": 4}
    chat = {"model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
    big = "word " * (LIMIT // 5 - 100)  # just under the limit: refused from its size
    return [
        ("completions", json.dumps({**good, "prompt": big}).encode()),
        ("chat/completions", json.dumps({**chat, "messages": [{"role": "user",
                                                               "content": big}]}).encode()),
        ("completions", b'{"model": "x", "prompt": "' + b"a" * (LIMIT * 3) + b'"}'),
        ("completions", b"[" * 5000 + b"]" * 5000),
        ("completions", b'{"a": ' * 1500 + b"1" + b"}" * 1500),
        ("completions", json.dumps({**good, "seed": -1}).encode()),
        ("completions", json.dumps({**good, "max_tokens": True}).encode()),
        ("chat/completions", json.dumps({**chat, "stream": "yes"}).encode()),
        ("chat/completions", json.dumps({**chat, "temperature": 1e999}).encode()
         .replace(b"Infinity", b"1e999")),
        ("chat/completions", json.dumps({**chat, "messages": [{"role": "robot",
                                                               "content": "x"}]}).encode()),
        ("chat/completions", json.dumps({**chat, "messages": []}).encode()),
        ("completions", json.dumps({**good, "prompt": list(range(5000))}).encode()),
        ("completions", b"\xff\xfe" * 1000),
        ("completions", json.dumps({**good, "prompt": "\ud800"}).encode()),
        ("chat/completions", json.dumps({**chat, "top_logprobs": 50, "logprobs": True})
         .encode()),
        ("completions", json.dumps(good).encode()[:-1] + b', "seed": ' + b"9" * 5000 + b"}"),
        ("completions", json.dumps({**good, "prompt": [5, -1], "echo": True}).encode()),
        ("completions", json.dumps({**good, "logit_bias": {"9" * 5000: 1}}).encode()),
        ("chat/completions", json.dumps({**chat, "chat_template_kwargs": {"self": 1}})
         .encode()),
        ("chat/completions", json.dumps({**chat, "guided_json": "[" * 50000 + "]" * 50000})
         .encode()),
        ("completions", json.dumps({**good, "guided_regex": "[^\\s\\S]"}).encode()),
        # a large answer (33,600 values), built off the event loop
        ("completions", json.dumps({**good, "prompt": [[5 + i] * 400 for i in range(4)],
                                    "echo": True, "logprobs": 20, "max_tokens": 1}).encode()),
    ]


async def one_round(client: httpx.AsyncClient, url: str, model: str, statuses: Counter):
    for path, body in bodies(model):
        r = await client.post(f"{url}/v1/{path}", content=body,
                              headers={"Content-Type": "application/json"})
        statuses[r.status_code] += 1
    # streams dropped after their first event, and a burst past the queue
    for _ in range(4):
        async with client.stream("POST", f"{url}/v1/chat/completions", json={
                "model": model, "messages": [{"role": "user", "content": "Tell a story."}],
                "max_tokens": 200, "stream": True}) as r:
            statuses[r.status_code] += 1
            async for _ in r.aiter_lines():
                break
    burst = await asyncio.gather(*(client.post(f"{url}/v1/completions", json={
        "model": model, "prompt": "Hi", "max_tokens": 2}) for _ in range(12)))
    for r in burst:
        statuses[r.status_code] += 1


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engine", default="engines/smollm2-135m")
    ap.add_argument("--rounds", type=int, default=50)
    ap.add_argument("--warm-up-rounds", type=int, default=10)
    ap.add_argument("--rss-bound-mb", type=float, default=64)
    ap.add_argument("--json", dest="json_out", default="hostile.json")
    args = ap.parse_args(argv)
    port = free_port()
    url, model = f"http://127.0.0.1:{port}", "hostile"
    proc = subprocess.Popen([sys.executable, "-m", "trt_spec.cli", "serve", "--engine",
                             args.engine, "--port", str(port), "--served-model-name", model,
                             "--max-waiting", "4"])
    statuses: Counter = Counter()
    try:
        wait_healthy(url, proc)

        async def run(rounds: int):
            async with httpx.AsyncClient(timeout=120) as client:
                for _ in range(3):  # warm-up: good requests, and one hostile round
                    await client.post(f"{url}/v1/completions", json={
                        "model": model, "prompt": "Hello", "max_tokens": 8})
                if rounds == 0:  # the same peak shapes: every KV slot, ORT's arenas at batch 8
                    for _ in range(args.warm_up_rounds):
                        await one_round(client, url, model, Counter())
                for _ in range(rounds):
                    await one_round(client, url, model, statuses)

        asyncio.run(run(0))
        time.sleep(1)
        before = rss_mb(proc.pid)
        t0 = time.perf_counter()
        asyncio.run(run(args.rounds))
        elapsed = time.perf_counter() - t0
        time.sleep(1)
        after = rss_mb(proc.pid)
        health = httpx.get(f"{url}/health", timeout=5).json()
    finally:
        proc.send_signal(signal.SIGTERM)
        exit_code = proc.wait(60)
    fivexx = sum(n for s, n in statuses.items() if s >= 500)
    report = {"rounds": args.rounds, "requests": sum(statuses.values()), "elapsed_s": elapsed,
              "statuses": dict(sorted(statuses.items())), "5xx": fivexx,
              "rss_mb": {"after_warm_up": before, "after": after, "growth": after - before,
                         "bound": args.rss_bound_mb},
              "health_after": health, "server_exit_code": exit_code}
    report["passed"] = fivexx == 0 and after - before <= args.rss_bound_mb and exit_code == 0
    Path(args.json_out).write_text(json.dumps(report, indent=2) + "\n")
    print(f"{report['requests']} hostile requests in {elapsed:.0f} s: statuses "
          f"{report['statuses']}, 5xx {fivexx}\n"
          f"server RSS {before:.0f} MB after warm-up -> {after:.0f} MB "
          f"({after - before:+.1f} MB; bound {args.rss_bound_mb:g} MB); exit code {exit_code}\n"
          f"{'PASS' if report['passed'] else 'FAIL'}; report: {args.json_out}")
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
