"""CPU time per decoded token, our plain decoding against onnxruntime-genai's, on a machine
loaded by others (docs/quantization.md, "The lean graph").

    .venv/bin/python scripts/plain_cpu.py --engine engines/lean-int4-plain \
        --ortgenai $TRT_SPEC_CACHE/smollm2-135m/ortgenai-int4 --num-prompts 8 --repeats 2

Every side runs at one intra-op thread, so the process's CPU time is the work alone, which a
loaded machine inflates far less than the wall time. Per prompt and side, interleaved:
C(N + 1) - C(1) over N, with C(n) the CPU time of decoding n tokens greedily after the prompt
(the prefill cancels). Ours runs as a user runs it:
- fast: a Generator loaded with --fast-decode (the target without attention rows),
- fast-rows: the exact Generator's target switched to fast decoding, as bench's `none-fast`
  runs it (the graph keeps its attention rows, fed 1),
- exact: exact decoding (the default);
with --general, also fast-general and exact-general: the same generators with the engine's
batch-1 plain path switched off (runtime/plain_step.py), every step through the general decode;
and for ours, the share spent inside the ONNX Runtime session (the rest is the Python loop).
Our sessions' memory is on huge pages (runtime/backends/huge_pages.py); fast-4k is fast with
it left on 4 KiB pages, and onnxruntime-genai-huge is theirs with its session collapsed the
same way (which it does not do itself).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import time
from pathlib import Path

import numpy as np

from trt_spec.runtime import plain_step
from trt_spec.runtime.backends.huge_pages import huge_pages
from trt_spec.runtime.generator import Generator
from trt_spec.runtime.sampling import SamplingParams
from trt_spec.runtime.scheduler import generate_ids
from trt_spec.tools.bench_prompts import load_prompts

lean_decode = plain_step.decode
SESSION = collections.Counter()  # generator label -> CPU seconds inside run_with_iobinding


def timed_session(gen: Generator, label: str) -> None:
    run = gen.target.session.run_with_iobinding

    def timed(io, *args, **kwargs):
        c0 = time.process_time()
        try:
            return run(io, *args, **kwargs)
        finally:
            SESSION[label] += time.process_time() - c0

    gen.target.session.run_with_iobinding = timed


def ortgenai_decoder(folder: Path, on_huge_pages: bool = False):
    """prompt ids, n -> decodes n tokens greedily with onnxruntime-genai at one thread;
    on_huge_pages: its session's memory collapsed onto huge pages as ours is
    (runtime/backends/huge_pages.py), which onnxruntime-genai does not do itself."""
    import onnxruntime_genai as og

    config = og.Config(str(folder))
    one = {"session_options": {"intra_op_num_threads": 1, "inter_op_num_threads": 1}}
    config.overlay(json.dumps({"model": {"decoder": one}}))
    if on_huge_pages:
        with huge_pages():
            model = og.Model(config)
    else:
        model = og.Model(config)

    def decode(ids: list[int], n: int) -> None:
        params = og.GeneratorParams(model)
        total = len(ids) + n
        params.set_search_options(max_length=total, min_length=total, do_sample=False,
                                  batch_size=1)
        generator = og.Generator(model, params)
        generator.append_tokens(np.asarray([ids], dtype=np.int32))
        while not generator.is_done():
            generator.generate_next_token()

    return decode


def general_decode(*args) -> bool:
    """runtime/plain_step.py's decode switched off: every step runs the general decode."""
    return False


def small_pages_generator(engine: str) -> Generator:
    """A fast-decoding Generator whose sessions stay on 4 KiB pages (TRT_SPEC_HUGE_PAGES=0)."""
    before = os.environ.get("TRT_SPEC_HUGE_PAGES")
    os.environ["TRT_SPEC_HUGE_PAGES"] = "0"
    try:
        return Generator(engine, threads=1, max_len=2048, prefix_cache=False,
                         exact_decode=False)
    finally:
        if before is None:
            del os.environ["TRT_SPEC_HUGE_PAGES"]
        else:
            os.environ["TRT_SPEC_HUGE_PAGES"] = before


def sides(engine: str, ortgenai: Path, general: bool = False,
          skip: tuple[str, ...] = ()) -> tuple[dict, Generator]:
    """label -> (decode(ids, n), the generator whose session it times, or None). Ours are
    made first, theirs last: of sessions on 4 KiB pages, the later made ran faster here
    (runtime/backends/huge_pages.py), so the order favours theirs."""
    fast = Generator(engine, threads=1, max_len=2048, prefix_cache=False, exact_decode=False)
    exact = Generator(engine, threads=1, max_len=2048, prefix_cache=False, exact_decode=True)
    timed_session(fast, "fast")
    timed_session(exact, "exact")
    small = None if "fast-4k" in skip else small_pages_generator(engine)
    if small is not None:
        timed_session(small, "fast-4k")

    def ours(gen: Generator, fast_decode: bool, plain_path: bool = True):
        def decode(ids: list[int], n: int) -> None:
            before, gen.target.exact_decode = gen.target.exact_decode, not fast_decode
            lean = plain_step.decode
            plain_step.decode = lean_decode if plain_path else general_decode
            try:
                generate_ids(gen, [ids], SamplingParams(max_tokens=n, temperature=0.0,
                                                        ignore_eos=True), "none", None)
            finally:
                gen.target.exact_decode = before
                plain_step.decode = lean
        return decode

    runs = {"fast": (ours(fast, True), "fast"), "fast-rows": (ours(exact, True), "exact"),
            "exact": (ours(exact, False), "exact")}
    if small is not None:
        runs["fast-4k"] = (ours(small, True), "fast-4k")
    if general:
        runs |= {"fast-general": (ours(fast, True, False), "fast"),
                 "exact-general": (ours(exact, False, False), "exact")}
    runs["onnxruntime-genai"] = (ortgenai_decoder(ortgenai), None)
    if "onnxruntime-genai-huge" not in skip:
        runs["onnxruntime-genai-huge"] = (ortgenai_decoder(ortgenai, True), None)
    return runs, fast


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--engine", default="engines/lean-int4-plain")
    ap.add_argument("--ortgenai", type=Path, required=True, help="its builder's model folder")
    ap.add_argument("--prompts", default="runtime/data/sharegpt-heldout.jsonl")
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--general", action="store_true",
                    help="also fast / exact with the batch-1 plain path off (before it)")
    ap.add_argument("--skip", default="", help="comma-separated sides not to run")
    args = ap.parse_args()
    runs, gen = sides(args.engine, args.ortgenai, args.general, tuple(args.skip.split(",")))
    runs = {k: v for k, v in runs.items() if k not in args.skip.split(",")}
    prompts = [gen.encode(p) for p in load_prompts(args.prompts)[:args.num_prompts]]
    n = args.max_new_tokens
    for decode, _ in runs.values():
        decode(prompts[0][:16], 4)  # warm
    cpu, inside = collections.defaultdict(list), collections.defaultdict(list)
    for _ in range(args.repeats):
        for ids in prompts:
            for label, (decode, session) in runs.items():
                s0, c0 = SESSION[session], time.process_time()
                decode(ids, 1)
                s1, c1 = SESSION[session], time.process_time()
                decode(ids, n + 1)
                s2, c2 = SESSION[session], time.process_time()
                cpu[label].append(((c2 - c1) - (c1 - c0)) * 1000 / n)
                if session:
                    inside[label].append(((s2 - s1) - (s1 - s0)) * 1000 / n)
    theirs = statistics.mean(cpu["onnxruntime-genai"])
    print("| side | CPU ms a token | in the session | the rest | against onnxruntime-genai |")
    print("|---|---|---|---|---|")
    for label, values in cpu.items():
        mean = statistics.mean(values)
        s = statistics.mean(inside[label]) if inside[label] else None
        cells = ("", "") if s is None else (f"{s:.2f}", f"{mean - s:.2f}")
        print(f"| {label} | {mean:.2f} | {cells[0]} | {cells[1]} | {theirs / mean:.3f}x |")


if __name__ == "__main__":
    main()
