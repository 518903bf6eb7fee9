"""Replay multi-turn conversations through `trt-spec serve`, as a chat client would: each turn
sends the whole conversation so far (every earlier question and the server's own answers)
with the official `openai` client, streamed, and times the first token.

    python scripts/replay.py --engine engines/smollm2-135m --compare --json replay.json
    python scripts/replay.py --url http://127.0.0.1:8000 --model smollm2-135m

--compare starts two servers on ENGINE, one with the prefix cache and one with
--no-prefix-cache, and replays each conversation on both, alternating which goes first; it
prints time to first token per turn side by side (median over the conversations whose
prompt at that turn has at least --min-tokens tokens, and over all), the ratio, and whether
the answers are identical. Without --compare it replays against --url or one server it
starts. Conversations: runtime/data/sharegpt-heldout-multiturn.jsonl (held-out ShareGPT
conversations, user turns only; `--make-data` writes it from the ShareGPT file).

--ray N serves the engine as N Ray Serve replicas (`serve --ray`); with --compare it replays
on prefix routing, then on load routing (one deployment at a time: two local Rays would
share the cores), and counts the later turns whose history came from a replica's cache.

Exits 1 when a request fails, or with --compare when an answer differs.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "runtime" / "data" / "sharegpt-heldout-multiturn.jsonl"
sys.path.insert(0, str(Path(__file__).resolve().parent))
from load import free_port, wait_healthy  # noqa: E402  (scripts/ sits beside this file)


def make_data(out: Path, conversations: int, turns: int, max_chars: int, min_chars: int) -> None:
    """Held-out ShareGPT conversations (the split no drafter trained on; one part of each) with
    >= `turns` user turns: their first `turns` user messages, each cut to `max_chars`, where
    those come to at least `min_chars` in all (long conversations: what a prefix cache is
    for)."""
    from trt_spec.export.sharegpt import fetch_sharegpt, is_heldout, read_conversations

    convs, _ = read_conversations(fetch_sharegpt())
    rows, bases = [], set()
    for conv in convs:
        base = conv.id.rsplit("_", 1)[0]  # ShareGPT's parts of one long conversation: one each
        if not is_heldout(conv.id) or base in bases:
            continue
        users = [m["content"][:max_chars] for m in conv.messages
                 if m["role"] == "user" and m["content"].strip()]
        if len(users) < turns or sum(map(len, users[:turns])) < min_chars:
            continue
        rows.append({"id": conv.id, "turns": users[:turns]})
        bases.add(base)
        if len(rows) == conversations:
            break
    out.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    print(f"{out}: {len(rows)} held-out conversations x {turns} user turns")


LONG_CHATS = ROOT / "runtime" / "data" / "sharegpt-heldout-longchats.jsonl"
LONG_ASKS = ("Above are messages people sent to an assistant. Summarise what they ask for in "
             "three sentences.")


def make_long_chats(out: Path, chats: int, first_tokens: int, engine: Path) -> None:
    """Chats whose first turn pastes a long text (>= first_tokens tokens of the engine's
    tokenizer) and asks about it, then two short follow-ups: the case a prefix cache must
    not lose. Only held-out ShareGPT conversations are read (the split no drafter trained
    on), and none of those the benchmark prompt files already use (the shipped held-out
    prompts and multi-turn chats, which tuning reads): each chat pastes the first user
    messages of its own conversations, and its follow-ups are their later short user turns."""
    from trt_spec.runtime.tokenizer import Tokenizer
    from trt_spec.export.sharegpt import fetch_sharegpt, is_heldout, read_conversations

    used = set()
    for path in (DATA, ROOT / "runtime" / "data" / "sharegpt-heldout.jsonl"):
        used |= {json.loads(line)["id"].rsplit("_", 1)[0]
                 for line in path.read_text().splitlines() if line.strip()}
    tok = Tokenizer(engine)
    convs, _ = read_conversations(fetch_sharegpt())
    pool, bases = [], set()
    for conv in convs:
        base = conv.id.rsplit("_", 1)[0]
        if not is_heldout(conv.id) or base in bases or base in used:
            continue
        users = [m["content"].strip() for m in conv.messages if m["role"] == "user"
                 and m["content"].strip()]
        if users:
            pool.append((conv.id, users))
            bases.add(base)
    rows = []
    while pool and len(rows) < chats:
        pasted, ids, follow = [], [], []
        while pool and len(tok.encode("\n\n".join(pasted))) < first_tokens:
            cid, users = pool.pop(0)
            pasted.append(users[0][:4000])
            ids.append(cid)
            follow += [u for u in users[1:] if len(u) <= 300]
        if len(tok.encode("\n\n".join(pasted))) < first_tokens:
            break
        follow = (follow + ["Which of those messages is the hardest to answer, and why?",
                            "Answer the first of them in two sentences."])[:2]
        rows.append({"id": "longchat-" + "+".join(ids), "source_ids": ids,
                     "turns": ["\n\n".join(pasted) + "\n\n" + LONG_ASKS, *follow]})
    out.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    print(f"{out}: {len(rows)} chats, first turns of {first_tokens}+ tokens, from "
          f"{sum(len(r['source_ids']) for r in rows)} held-out conversations")


def load_conversations(path: Path, n: int | None) -> list[dict]:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    for r in rows:
        if not (isinstance(r.get("turns"), list) and r["turns"]
                and all(isinstance(t, str) for t in r["turns"])):
            raise ValueError(f"{path}: conversation {r.get('id')!r} needs 'turns': a list of "
                             "user messages")
    return rows[:n]


def replay_turn(client, model: str, messages: list[dict], max_tokens: int) -> dict:
    """One streamed turn -> answer, time to first token and total seconds, usage."""
    t0 = time.perf_counter()
    ttft, parts, usage = None, [], None
    stream = client.chat.completions.create(
        model=model, messages=messages, max_tokens=max_tokens, temperature=0, stream=True,
        stream_options={"include_usage": True})
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            if choice.delta.content:
                ttft = ttft if ttft is not None else time.perf_counter() - t0
                parts.append(choice.delta.content)
    details = getattr(usage, "prompt_tokens_details", None)
    return {"answer": "".join(parts), "ttft_s": ttft, "seconds": time.perf_counter() - t0,
            "prompt_tokens": usage.prompt_tokens if usage else None,
            "cached_tokens": (details.cached_tokens or 0) if details else 0}


def replay(client, model: str, conv: dict, max_tokens: int) -> list[dict]:
    """The conversation's turns until its last, or until the next prompt no longer fits the
    server's context (a 400, as a chat client would get): the turns before it."""
    import openai

    messages, out = [], []
    for text in conv["turns"]:
        messages.append({"role": "user", "content": text})
        try:
            r = replay_turn(client, model, messages, max_tokens)
        except openai.BadRequestError as e:
            if "the context holds" not in str(e):
                raise
            print(f"  {conv['id']}: turn {len(out) + 1} does not fit the context; "
                  f"{len(out)} turns replayed", flush=True)
            break
        messages.append({"role": "assistant", "content": r["answer"]})
        out.append(r)
    return out


def start(engine: str, port: int, args, extra: list[str]) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "trt_spec.cli", "serve", "--engine", engine, "--port",
           str(port), "--max-num-seqs", str(args.max_num_seqs), *extra, *args.server_args]
    proc = subprocess.Popen(cmd)
    wait_healthy(f"http://127.0.0.1:{port}", proc, timeout=300 if "--ray" in extra else 120)
    return proc


def median(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def summarize(runs: dict[str, list[list[dict]]], min_tokens: int) -> list[dict]:
    """Per turn: median TTFT of each side, over the long prompts and over all."""
    rows = []
    turns = max(len(c) for side in runs.values() for c in side)
    for t in range(turns):
        row = {"turn": t + 1}
        for name, convs in runs.items():
            at = [c[t] for c in convs if len(c) > t]
            long = [r for r in at if (r["prompt_tokens"] or 0) >= min_tokens]
            row[name] = {"conversations": len(at), "long": len(long),
                         "prompt_tokens": median([r["prompt_tokens"] for r in at]),
                         "cached_tokens": median([r["cached_tokens"] for r in at]),
                         "ttft_s": median([r["ttft_s"] for r in at]),
                         "ttft_long_s": median([r["ttft_s"] for r in long])}
        rows.append(row)
    return rows


def replay_all(sides: dict, convs: list[dict], args, model: str | None,
               ray_extra: list[str] | None) -> str | None:
    """Every conversation on every side's server (started here, or --url), turn by turn,
    alternating which side goes first; the results are appended to `sides`."""
    import openai

    procs, clients = {}, {}
    try:
        for name in sides:
            if args.url:
                url = args.url
            else:
                port = free_port()
                extra = ray_extra if ray_extra is not None else \
                    ["--no-prefix-cache"] if name == "no-cache" else []
                procs[name] = start(args.engine, port, args, extra)
                url = f"http://127.0.0.1:{port}"
            clients[name] = openai.OpenAI(base_url=f"{url}/v1", api_key="unused",
                                          max_retries=0, timeout=600)
            if model is None:
                model = clients[name].models.list().data[0].id
        for i, conv in enumerate(convs):
            order = list(sides) if i % 2 == 0 else list(sides)[::-1]  # alternate who goes first
            for name in order:
                sides[name].append(replay(clients[name], model, conv, args.max_tokens))
            line = "  ".join(f"{name}: " + " ".join(f"{r['ttft_s']:.2f}" for r in sides[name][-1])
                             for name in sides)
            print(f"[{i + 1}/{len(convs)}] {conv['id']}: time to first token per turn (s)  "
                  f"{line}", flush=True)
    finally:
        for p in procs.values():
            p.terminate()
            p.wait(120)
    return model


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine", help="engine folder: start its server(s) here")
    ap.add_argument("--url", help="a running server instead (not with --compare)")
    ap.add_argument("--model", default=None, help="model id [default: the engine's name]")
    ap.add_argument("--conversations", type=Path, default=DATA, help="JSON lines of {id, turns}")
    ap.add_argument("--num-conversations", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=128, help="answer length per turn")
    ap.add_argument("--min-tokens", type=int, default=1000,
                    help="a turn counts as long from this many prompt tokens")
    ap.add_argument("--max-num-seqs", type=int, default=4, help="the servers' KV slots")
    ap.add_argument("--compare", action="store_true",
                    help="with and without the prefix cache, side by side (with --ray: "
                         "routing by prefix, then by load)")
    ap.add_argument("--ray", type=int, metavar="N", default=0,
                    help="serve on Ray Serve with N replicas")
    ap.add_argument("--json", type=Path, help="write the per-turn results here")
    ap.add_argument("--make-data", action="store_true",
                    help="write --conversations from the ShareGPT file's held-out split, exit")
    ap.add_argument("--turns", type=int, default=4, help="--make-data: user turns each")
    ap.add_argument("--make-count", type=int, default=40, help="--make-data: conversations")
    ap.add_argument("--max-chars", type=int, default=3000, help="--make-data: per message")
    ap.add_argument("--min-chars", type=int, default=2000,
                    help="--make-data: user text per conversation, at least")
    ap.add_argument("--make-long-chats", action="store_true",
                    help=f"write {LONG_CHATS.relative_to(ROOT)} (or --conversations when given)"
                         " from held-out ShareGPT conversations no prompt file uses, exit")
    ap.add_argument("--first-tokens", type=int, default=1000,
                    help="--make-long-chats: tokens of each first turn, at least")
    ap.add_argument("server_args", nargs="*", help="after --: more `trt-spec serve` options")
    args = ap.parse_args(argv)
    if args.make_long_chats:
        if not args.engine:
            ap.error("--make-long-chats counts tokens with --engine's tokenizer: give --engine")
        out = args.conversations if args.conversations != DATA else LONG_CHATS
        make_long_chats(out, args.make_count if args.make_count != 40 else 8,
                        args.first_tokens, Path(args.engine))
        return 0
    if args.make_data:
        make_data(args.conversations, args.make_count, args.turns, args.max_chars,
                  args.min_chars)
        return 0
    if bool(args.engine) == bool(args.url) or (args.compare and not args.engine):
        ap.error("give --engine (servers started here; --compare needs it) or --url")
    convs = load_conversations(args.conversations, args.num_conversations)
    model = args.model or (Path(args.engine).resolve().name if args.engine else None)
    if args.ray and args.url:
        ap.error("--ray starts its own deployment: give --engine, not --url")
    if args.ray:
        sides = {"prefix": [], "load": []} if args.compare else {"server": []}
    else:
        sides = {"cache": [], "no-cache": []} if args.compare else {"server": []}
    if args.ray:  # one deployment at a time, each replaying every conversation
        for name in sides:
            extra = ["--ray", "--replicas", str(args.ray)]
            extra += ["--routing", name] if args.compare else []
            model = replay_all({name: sides[name]}, convs, args, model, extra)
    else:
        model = replay_all(sides, convs, args, model, None)
    table = summarize(sides, args.min_tokens)
    differ = 0
    if args.compare:
        for a, b in zip(*sides.values()):
            differ += sum(x["answer"] != y["answer"] for x, y in zip(a, b))
    print(f"\n{'turn':>4}  " + "  ".join(f"{n + ' prompt':>16} {n + ' cached':>14} "
                                       f"{n + ' ttft':>12} {'(>=' + str(args.min_tokens) + ')':>9}"
                                       for n in sides) + ("  ratio (long)" if args.compare else ""))
    for row in table:
        cells = []
        for n in sides:
            c = row[n]
            long = f"{c['ttft_long_s']:.3f}" if c["ttft_long_s"] is not None else "-"
            cells.append(f"{c['prompt_tokens'] or 0:>16.0f} {c['cached_tokens'] or 0:>14.0f} "
                         f"{c['ttft_s']:>12.3f} {long + ' (' + str(c['long']) + ')':>9}")
        ratio = ""
        first, second = (row[n]["ttft_long_s"] for n in list(sides)[:2]) if args.compare \
            else (None, None)
        if first and second:
            ratio = f"  {first / second:.3f}"
        print(f"{row['turn']:>4}  " + "  ".join(cells) + ratio)
    for name, convs_run in sides.items():
        later = [r for c in convs_run for r in c[1:]]
        kept = sum(r["cached_tokens"] * 2 > (r["prompt_tokens"] or 0) for r in later)
        print(f"{name}: later turns that read their history from the cache: {kept} of "
              f"{len(later)}")
    if args.compare:
        total = sum(len(c) for c in next(iter(sides.values())))
        how = "routed by prefix and by load" if args.ray else "with and without the cache"
        print(f"answers identical {how}: {total - differ} of {total} turns")
    if args.json:
        args.json.write_text(json.dumps({
            "machine": platform.processor() or platform.machine(), "engine": args.engine,
            "conversations": len(convs), "max_tokens": args.max_tokens,
            "min_tokens": args.min_tokens, "turns": table, "answers_differ": differ,
            "runs": sides}, indent=1))
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
