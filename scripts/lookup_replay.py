"""Replay an engine's greedy answers through the suffix lookup, with and without the folder's
corpus table: how often each drafts, and the τ its drafts would reach, without timing.

    python scripts/lookup_replay.py --engine engines/smollm2-135m \
        --prompts runtime/data/sharegpt-heldout.jsonl --num-prompts 40 --max-new-tokens 128 -k 4

The engine answers each prompt greedily (method none); then, position by position, the suffix
lookup (runtime/proposers/suffix.py, its own tokens and the table, no cache of other requests
and no length cut) drafts up to k tokens, the greedy answer accepts a prefix, and the replay
moves on by that prefix and the bonus token, as a speculative step would. τ and the share of
steps that drafted are printed per configuration; speed needs `trt-spec bench`.
"""

from __future__ import annotations

import argparse
from types import SimpleNamespace

from trt_spec.runtime.generator import Generator
from trt_spec.runtime.proposers.suffix import SuffixProposer
from trt_spec.runtime.sampling import SamplingParams
from trt_spec.tools.bench import load_prompts
from trt_spec.runtime.scheduler import generate_ids


def replay(answers, lookup: SuffixProposer, k: int) -> tuple[float, float]:
    """(τ, share of steps that drafted) of `lookup` over (prompt ids, answer ids) pairs."""
    steps = tokens = drafted = 0
    for n, (prompt, answer) in enumerate(answers):
        t = 0
        while t < len(answer):
            s = SimpleNamespace(prompt_ids=prompt, output_ids=answer[:t], slot=0, id=n,
                                params=SamplingParams())
            draft = lookup.draft_n(s, k)[0].tolist()
            accepted = 0
            while (accepted < len(draft) and t + accepted < len(answer)
                   and draft[accepted] == answer[t + accepted]):
                accepted += 1
            drafted += bool(draft)
            t += accepted + 1
            tokens += accepted + 1
            steps += 1
    return tokens / steps, drafted / steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engine", default="engines/smollm2-135m")
    ap.add_argument("--prompts", default=None, help="FILE.jsonl (default: the 8 default prompts)")
    ap.add_argument("--num-prompts", type=int, default=40)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("-k", type=int, default=4, help="tokens drafted at most per step")
    args = ap.parse_args()
    gen = Generator(args.engine, max_batch=1, prefix_cache=False)
    table = gen.corpus()
    if table is None:
        raise SystemExit(f"{args.engine} has no corpus table (trt-spec corpus --engine ...)")
    prompts = load_prompts(args.prompts)[:args.num_prompts]
    params = SamplingParams(max_tokens=args.max_new_tokens, ignore_eos=True)
    answers = []
    for i, p in enumerate(prompts):
        (s,) = generate_ids(gen, [gen.encode(p)], params, "none")
        answers.append((list(s.prompt_ids), list(s.output_ids)))
        print(f"answered {i + 1}/{len(prompts)}", flush=True)
    c = gen.speculation
    for name, corpus in (("own tokens only", None), ("own tokens + corpus table", table)):
        lookup = SuffixProposer(c.ngram_min, c.ngram_max, corpus=lambda t=corpus: t)
        tau, share = replay(answers, lookup, args.k)
        print(f"{name:28s} k={args.k}: tau {tau:.3f}, drafted at {share:.0%} of steps")


if __name__ == "__main__":
    main()
