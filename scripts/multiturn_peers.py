"""Multi-turn chats against the peers: each runtime answers every turn of held-out chats
(greedy; its own answers stay in the history, as a chat client sends them back) and the time
to its first token is taken per turn, each runtime keeping what it can between turns:

  ours               `trt-spec serve` (server defaults: the prefix cache on, method auto),
                     the openai client, streamed
  llama.cpp          llama-server (one slot), /completion with the prompt's token ids and
                     `cache_prompt: true` (the slot keeps the last request's rows), streamed
  onnxruntime-genai  its Python API, one generator kept across turns (and chats, as a
                     server's one slot): rewound to the tokens it shares with the next prompt
                     (`rewind_to`), the rest appended (`append_tokens`); in-process, so no
                     HTTP hop (~1 ms) in its times

Every runtime reads the same prompt: our chat template over the chat so far (ours applies
it in the server; the peers are sent its token ids). The runtimes take each turn in turn
(interleaved), so the machine's drift falls on all of them; each answers one short
untimed prompt first (one-time work, and the template's system prompt in its cache). Chats:
runtime/data/chats-heldout-multiturn.jsonl (8 held-out chats of 4-5 user turns).

    python scripts/multiturn_peers.py --engine engines/smollm2-135m --json multiturn.json

Prints time to first token per turn index (median over chats) per runtime, with the median
prompt length and the tokens each reused from the turn before.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "runtime" / "data" / "chats-heldout-multiturn.jsonl"
sys.path.insert(0, str(Path(__file__).resolve().parent))
from load import free_port, wait_healthy  # noqa: E402  (scripts/ sits beside this file)
from replay import load_conversations  # noqa: E402


class Ours:
    """`trt-spec serve` in a child process, asked through the openai client."""
    name = "ours (serve)"

    def __init__(self, engine: str, threads: int | None, server_args: list[str]):
        import openai

        port = free_port()
        cmd = [sys.executable, "-m", "trt_spec.cli", "serve", "--engine", engine, "--port",
               str(port), *(["--threads", str(threads)] if threads else []), *server_args]
        self.proc = subprocess.Popen(cmd)
        wait_healthy(f"http://127.0.0.1:{port}", self.proc)
        self.client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused",
                                    max_retries=0, timeout=600)
        self.model = self.client.models.list().data[0].id

    def turn(self, messages: list[dict], ids: list[int], max_tokens: int) -> dict:
        t0 = time.perf_counter()
        ttft, parts, usage = None, [], None
        for chunk in self.client.chat.completions.create(
                model=self.model, messages=messages, max_tokens=max_tokens, temperature=0,
                stream=True, stream_options={"include_usage": True}):
            usage = chunk.usage or usage
            for choice in chunk.choices:
                if choice.delta.content:
                    ttft = ttft if ttft is not None else time.perf_counter() - t0
                    parts.append(choice.delta.content)
        details = getattr(usage, "prompt_tokens_details", None)
        assert usage.prompt_tokens == len(ids), (usage.prompt_tokens, len(ids))  # one template
        return {"answer": "".join(parts), "ttft_s": ttft, "prompt_tokens": usage.prompt_tokens,
                "reused_tokens": (details.cached_tokens or 0) if details else 0}

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(60)


class LlamaCpp:
    """llama-server with one slot; cache_prompt keeps its rows between requests."""
    name = "llama.cpp (cache_prompt)"

    def __init__(self, ctx, decode):
        from trt_spec.tools.peers.llamacpp import LlamaCppPeer

        self.peer, self.decode = LlamaCppPeer(), decode
        self.peer.load(ctx)  # multi-token batches where the build allows (else -ub 1)
        self.engine = self.peer.engine

    def turn(self, messages: list[dict], ids: list[int], max_tokens: int) -> dict:
        body = {"prompt": ids, "n_predict": max_tokens, "temperature": 0.0, "top_k": 1,
                "cache_prompt": True, "return_tokens": True, "stream": True}
        request = urllib.request.Request(self.peer.server.url + "/completion",
                                         data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        t0 = time.perf_counter()
        ttft, tokens, timings = None, [], {}
        with urllib.request.urlopen(request, timeout=600) as r:
            for line in r:
                if not line.startswith(b"data: "):
                    continue
                event = json.loads(line[6:])
                if event.get("tokens"):
                    ttft = ttft if ttft is not None else time.perf_counter() - t0
                    tokens += event["tokens"]
                timings = event.get("timings", timings)
        return {"answer": self.decode(tokens), "ttft_s": ttft, "prompt_tokens": len(ids),
                "reused_tokens": timings.get("cache_n", len(ids) - timings.get("prompt_n", 0))}

    def close(self) -> None:
        self.peer.close()


class OrtGenai:
    """Its generator, kept for the whole chat: rewound to the shared prefix, then appended."""
    name = "onnxruntime-genai (append_tokens)"

    def __init__(self, ctx, decode, eos_ids: set[int], context: int):
        import onnxruntime_genai as og

        from trt_spec.tools.peers.ortgenai import OrtGenaiPeer

        self.peer, self.decode, self.eos_ids = OrtGenaiPeer(), decode, eos_ids
        self.peer.load(ctx)
        self.engine = self.peer.engine
        limit = json.loads((self.peer.folder / "genai_config.json").read_text())["model"][
            "context_length"]
        params = og.GeneratorParams(self.peer.model)
        params.set_search_options(max_length=min(context, limit), do_sample=False, batch_size=1)
        self.generator = og.Generator(self.peer.model, params)

    def turn(self, messages: list[dict], ids: list[int], max_tokens: int) -> dict:
        import numpy as np

        g = self.generator
        seq = [int(t) for t in g.get_sequence(0)]
        shared = next((i for i, (a, b) in enumerate(zip(seq, ids)) if a != b),
                      min(len(seq), len(ids)))
        # the last token it sampled has no rows in its cache yet: it is fed again
        keep = min(shared, max(len(seq) - 1, 0), len(ids) - 1)
        t0 = time.perf_counter()
        if keep < len(seq):
            g.rewind_to(keep)
        g.append_tokens(np.asarray([ids[keep:]], dtype=np.int32))
        g.generate_next_token()
        ttft = time.perf_counter() - t0
        start = len(ids)
        while (not g.is_done() and g.token_count() - start < max_tokens
               and int(g.get_sequence(0)[-1]) not in self.eos_ids):
            g.generate_next_token()
        answer = [int(t) for t in g.get_sequence(0)[start:]]
        return {"answer": self.decode(answer), "ttft_s": ttft, "prompt_tokens": len(ids),
                "reused_tokens": keep}

    def close(self) -> None:
        self.generator = None
        self.peer.close()


def median(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine", default="engines/smollm2-135m")
    ap.add_argument("--conversations", type=Path, default=DATA, help="JSON lines of {id, turns}")
    ap.add_argument("--num-conversations", type=int, default=None)
    ap.add_argument("--max-tokens", type=int, default=96, help="answer length per turn, at most")
    ap.add_argument("--threads", type=int, default=None,
                    help="every runtime's threads [default: what our ORT sessions take]")
    ap.add_argument("--peers", default="llama.cpp,onnxruntime-genai")
    ap.add_argument("--json", type=Path, help="write the per-turn results here")
    ap.add_argument("server_args", nargs="*", help="after --: more `trt-spec serve` options")
    args = ap.parse_args(argv)

    from trt_spec.runtime.generator import Generator
    from trt_spec.tools.bench import machine
    from trt_spec.tools.peers import PEERS, peer_context

    names = [n.strip() for n in args.peers.split(",") if n.strip()]
    for name in names:
        if name not in ("llama.cpp", "onnxruntime-genai"):
            ap.error(f"--peers: {name!r}: this script runs llama.cpp and onnxruntime-genai")
    convs = load_conversations(args.conversations, args.num_conversations)
    gen = Generator(args.engine, max_batch=1)  # our template and tokenizer, for every runtime
    ctx = peer_context(gen.manifest.data, args.threads, 4, gen.manifest.folder)
    eos = {gen.tokenizer.eos_token_id} | set(gen.tokenizer.special_ids)
    runtimes, skipped = [Ours(args.engine, args.threads, args.server_args)], {}
    try:
        for name in names:
            ok, reason = PEERS[name]().available()
            try:
                if ok:
                    runtimes.append(LlamaCpp(ctx, gen.tokenizer.decode) if name == "llama.cpp"
                                    else OrtGenai(ctx, gen.tokenizer.decode, eos, 2048))
            except Exception as e:  # reported as skipped, with the reason, as bench does
                ok, reason = False, f"load failed: {type(e).__name__}: {e}"
            if not ok:
                skipped[name] = reason
        for rt in runtimes:  # untimed: one-time work, and the system prompt cached
            hello = [{"role": "user", "content": "Hello."}]
            rt.turn(hello, gen.encode(hello), 8)
        results = {rt.name: [] for rt in runtimes}
        for i, conv in enumerate(convs):
            histories = {rt.name: [] for rt in runtimes}
            for t, text in enumerate(conv["turns"]):
                for rt in runtimes:  # interleaved, turn by turn
                    messages = histories[rt.name] + [{"role": "user", "content": text}]
                    ids = gen.encode(messages)
                    r = rt.turn(messages, ids, args.max_tokens)
                    histories[rt.name] = messages + [{"role": "assistant", "content": r["answer"]}]
                    results[rt.name].append({"chat": conv["id"], "turn": t + 1, **r})
            print(f"[{i + 1}/{len(convs)}] {conv['id']}: " + "  ".join(
                f"{rt.name.split()[0]} " + " ".join(f"{r['ttft_s']:.3f}" for r in
                                                    results[rt.name][-len(conv['turns']):])
                for rt in runtimes), file=sys.stderr, flush=True)
    finally:
        for rt in runtimes:
            rt.close()
    turns = max(r["turn"] for rows in results.values() for r in rows)
    table = []
    for t in range(1, turns + 1):
        row = {"turn": t}
        for name, rows in results.items():
            at = [r for r in rows if r["turn"] == t]
            row[name] = {"chats": len(at), "ttft_s": median([r["ttft_s"] for r in at]),
                         "prompt_tokens": median([r["prompt_tokens"] for r in at]),
                         "reused_tokens": median([r["reused_tokens"] for r in at])}
        table.append(row)
    names = list(results)
    print("| turn | " + " | ".join(f"{n}: TTFT ms (prompt / reused tokens)" for n in names)
          + " |")
    print("|---|" + "---|" * len(names))
    for row in table:
        print(f"| {row['turn']} | " + " | ".join(
            f"{1000 * row[n]['ttft_s']:.0f} ({row[n]['prompt_tokens']:.0f} / "
            f"{row[n]['reused_tokens']:.0f})" for n in names) + " |")
    for name, reason in skipped.items():
        print(f"skipped {name}: {reason}")
    if args.json:
        args.json.write_text(json.dumps({
            "machine": machine(), "engine": args.engine, "max_tokens": args.max_tokens,
            "runtimes": {rt.name: getattr(rt, "engine", "trt-spec serve") for rt in runtimes},
            "skipped": skipped, "turns": table, "runs": results}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
