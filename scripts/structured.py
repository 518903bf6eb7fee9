"""Structured outputs over a set of JSON schemas (default tests/data/schemas.jsonl), or of
tool calls (--tool-calls tests/data/tool_calls.jsonl: tool_choice required or a named
function, the output held to the call grammar): for each method, whether every answer parses
and validates, whether greedy output equals plain decoding's under the same grammar, and
decode tokens/s with grammar-forced drafting on and off, interleaved in one process (plain
decoding without forced drafts is the baseline). A model drafter (vanilla, mtp, eagle,
eagle3) also runs unsteered (`-unsteered`: drafting without the grammar's mask,
--no-grammar-drafts), so its acceptance under the schema is measured with and without it.

    python scripts/structured.py --engine engines/smollm2-135m --methods none,ngram,hybrid,eagle3
    python scripts/structured.py --tool-calls tests/data/tool_calls.jsonl --methods none,ngram,hybrid
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODEL_DRAFTERS = ("vanilla", "mtp", "eagle", "eagle3")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engine", default="engines/smollm2-135m")
    ap.add_argument("--schemas", default=str(ROOT / "tests/data/schemas.jsonl"))
    ap.add_argument("--tool-calls", default=None,
                    help="a JSONL of tool-call tasks (messages, tools, tool_choice) instead")
    ap.add_argument("--methods", default="none,ngram,hybrid,eagle3,mtp")
    ap.add_argument("--num-draft-tokens", type=int, default=4)
    ap.add_argument("--forced-tokens", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--json", dest="json_out", default=None)
    args = ap.parse_args(argv)

    from trt_spec.runtime.generator import Generator
    from trt_spec.runtime.scheduler import generate_ids
    from trt_spec.runtime.proposers.suffix import SuffixCache

    path = args.tool_calls or args.schemas
    cases = [json.loads(line) for line in Path(path).read_text().splitlines() if line]
    # (forced tokens, exact decoding) -> a generator; the fastest plain decoding a user can
    # run (--fast-decode: 1-token steps on one-row kernels) is the second baseline
    gens = {(f, exact, steer): Generator(args.engine, forced_tokens=f, threads=args.threads,
                                         max_len=2048, prefix_cache=False, exact_decode=exact,
                                         grammar_drafts=steer)
            for f, exact, steer in ((0, True, True), (0, False, True),
                                    (args.forced_tokens, True, True),
                                    (args.forced_tokens, True, False))}
    methods = args.methods.split(",")
    models = [m for m in methods if m in MODEL_DRAFTERS]
    configs = [("none", 0), ("none-fast", 0)] + [(m, args.forced_tokens) for m in methods] \
        + [(f"{m}-unsteered", args.forced_tokens) for m in models]
    rows = {c: {"tokens": 0, "seconds": 0.0, "forwards": 0, "valid": 0, "same": 0, "n": 0,
                "mask_s": 0.0, "masks": 0, "score_s": 0.0, "steps": 0, "proposed": 0,
                "accepted": 0, "model_drafted": 0, "model_accepted": 0} for c in configs}
    for rep in range(args.repeats):
        for case in cases:
            base = None
            for label, forced in configs:  # interleaved per schema
                method = label.removesuffix("-fast").removesuffix("-unsteered")
                gen = gens[forced, not label.endswith("-fast"),
                           not label.endswith("-unsteered")]
                params, ids, valid = task(gen, case, args.max_tokens)
                gen.use_suffix_cache(SuffixCache())  # no answer of another run to match
                t0 = time.perf_counter()
                s = generate_ids(gen, [ids], params, method,
                                     None if method == "none" else args.num_draft_tokens)[0]
                m, r = s.metrics(), rows[label, forced]
                r["seconds"] += m.decode_s
                r["tokens"] += max(m.completion_tokens - 1, 0)
                r["forwards"] += m.target_forwards
                r["steps"] += max(m.target_forwards - 1, 1)
                r["mask_s"] += m.mask_s
                r["masks"] += m.masks
                r["score_s"] += m.score_s
                r["proposed"] += m.proposed_tokens
                r["accepted"] += m.accepted_tokens
                drafted, kept = model_drafts(s.sources)
                r["model_drafted"] += drafted
                r["model_accepted"] += kept
                r["n"] += 1
                r["valid"] += s.finish_reason == "stop" and valid(s.text)
                base = s.output_ids if base is None else base
                r["same"] += s.output_ids == base
                print(f"pass {rep + 1} {case['name']:16s} {label:9s} forced {forced}: "
                      f"{m.completion_tokens} tokens, {time.perf_counter() - t0:.2f} s",
                      file=sys.stderr)
    plain_rate = rows["none", 0]["tokens"] / rows["none", 0]["seconds"]
    fast_rate = rows["none-fast", 0]["tokens"] / rows["none-fast", 0]["seconds"]
    kind = "tool-call tasks" if args.tool_calls else "schemas"
    print(f"{len(cases)} {kind} x {args.repeats}, max_tokens {args.max_tokens}, greedy\n")
    print("| method | forced tokens | valid | = plain | tok/s | x plain | x fastest plain | tau "
          "| acceptance | model drafts accepted | mask us/step | mask % of score |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    table = {}
    for (method, forced), r in rows.items():
        rate = r["tokens"] / r["seconds"]
        table[f"{method}/{forced}"] = dict(r, tokens_per_s=rate, x_plain=rate / plain_rate,
                                           x_fast_plain=rate / fast_rate)
        print(f"| {method} | {forced} | {r['valid']}/{r['n']} | {r['same']}/{r['n']} | "
              f"{rate:.1f} | {rate / plain_rate:.2f} | {rate / fast_rate:.2f} | "
              f"{(r['tokens'] + r['n']) / r['forwards']:.2f} | "
              f"{r['accepted'] / max(r['proposed'], 1):.2f} | "
              f"{model_rate(r)} | "
              f"{1e6 * r['mask_s'] / r['steps']:.0f} | "
              f"{100 * r['mask_s'] / r['score_s']:.1f}% |")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(table, indent=1) + "\n")
    return 0


def model_drafts(sources) -> tuple[int, int]:
    """(tokens a model drafter drafted, of them accepted) from a stream's token sources
    (runtime/provenance.py): a step's `drafted` is on each of its tokens."""
    steps = {t.step: t for t in sources if t.drafter in MODEL_DRAFTERS}
    kept = sum(t.source in ("head", "draft") for t in sources)
    return sum(t.drafted for t in steps.values()), kept


def model_rate(r: dict) -> str:
    if not r["model_drafted"]:
        return "-"
    return f"{r['model_accepted'] / r['model_drafted']:.2f} of {r['model_drafted']}"


def task(gen, case: dict, max_tokens: int):
    """(params, prompt ids, valid(text)) of one case: a JSON schema's, or a tool call's (the
    tools shown in the template's format, the output held to the call grammar)."""
    import jsonschema

    from trt_spec.runtime.chat import Chat
    from trt_spec.runtime.sampling import SamplingParams

    def validates(value, schema) -> bool:
        try:
            jsonschema.validate(value, schema)
            return True
        except jsonschema.ValidationError:
            return False

    if "json_schema" in case:
        def valid(text: str) -> bool:
            try:
                return validates(json.loads(text), case["json_schema"])
            except ValueError:
                return False

        return (SamplingParams(max_tokens=max_tokens, json_schema=case["json_schema"]),
                gen.encode(case["messages"]), valid)
    chat = Chat.of(gen.tokenizer, case["tools"], case["tool_choice"], False)  # as LLM.chat
    ids = chat.encode(case["messages"])
    params, reading = chat.hold(ids, SamplingParams(max_tokens=max_tokens))
    schemas = {t.name: t.parameters for t in chat.tools}

    def valid(text: str) -> bool:
        calls = reading.read(text)[2]
        return bool(calls) and all(validates(json.loads(c.arguments), schemas[c.name])
                                   for c in calls)

    return params, ids, valid


if __name__ == "__main__":
    sys.exit(main())
