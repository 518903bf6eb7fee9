"""Where one decoded token's time goes: the graph alone, and each layer the runtime adds.

For one configuration (plain exact, plain fast, or a speculative step that verifies k drafts)
at batch 1 after a past of P tokens, milliseconds per target forward:

    graph       session.run_with_iobinding alone, every input and output already bound
    binding     OrtTarget.run less the graph: binding the step's inputs, fresh output arrays
    inputs      StepGraph.step less OrtTarget.run: the padded step inputs, the logits sliced,
                the cache lengths advanced
    propose     the engine's propose phase: the policy's plan, drafting (speculative), the
                batch's width
    sample      sampling (plain) or verification (speculative), and committing the tokens:
                stop checks, cache rewinds, counters
    loop        the rest of a decode step: the scheduler, admission, streaming out

The first three are timed directly (median of interleaved repeats, each shape run a few
times in a row first, as the runtime does); propose, sample and the total come from the
request metrics of a real generation over the same prompt, so `loop` is the total less the
others. Runs on the ONNX Runtime backend only.
"""

from __future__ import annotations

import statistics
import time

import numpy as np

from trt_spec.runtime.methods import PLAIN
from trt_spec.runtime.sampling import SamplingParams
from trt_spec.runtime.settings import SpeculationConfig
from trt_spec.runtime.step_inputs import SlotTokens, build_step_inputs
from trt_spec.tools.step_costs import synthetic_prompt
from trt_spec.runtime.scheduler import generate_ids

PARTS = ("graph", "binding", "inputs", "propose", "sample", "loop")
K = SpeculationConfig.num_draft_tokens  # the k a speculative row drafts, unless told


def _median_ms(fn, repeats: int, block: int = 3) -> float:
    times = []
    for _ in range(repeats):
        for _ in range(block):
            t0 = time.perf_counter()
            fn()
            elapsed = time.perf_counter() - t0
        times.append(elapsed)  # the last of each block: the shape already warm
    return 1000 * statistics.median(times)


def layers(gen, past: int, rows: int, repeats: int = 30) -> dict[str, float]:
    """graph / binding / inputs (ms) of one target forward of `rows` new tokens after `past`,
    logits wanted at every row (as a verification wants them)."""
    target, cache = gen.target, gen.cache
    if not hasattr(target, "session"):
        raise ValueError(f"backend {gen.backend!r}: the decomposition times ONNX Runtime "
                         "sessions (--backend ort)")
    slot = cache.allocate()
    try:
        cache.lengths[slot] = 0
        target.step(cache, [SlotTokens(slot, synthetic_prompt(gen, past), [past - 1])])
        tokens = synthetic_prompt(gen, rows)
        request = [SlotTokens(slot, tokens, list(range(rows)))]

        def step():
            target.step(cache, request)
            cache.rewind(slot, past)

        run_inputs, _ = target.prepare(cache, request)
        inputs = build_step_inputs(cache, run_inputs, target.max_positions)

        bound: list = []  # the output arrays the binding writes into, kept alive

        def run():
            bound[:] = [target.run(cache, inputs, ())]

        io = target._binding(cache, inputs.lo, inputs.hi)

        def graph():
            target.session.run_with_iobinding(io)

        times: dict[str, list[float]] = {"graph": [], "run": [], "step": []}
        for _ in range(repeats):
            run()  # binds every input and output; the graph alone reruns that binding  # interleaved, so drift hits all three alike
            times["graph"].append(_median_ms(graph, 1))
            times["run"].append(_median_ms(run, 1))
            times["step"].append(_median_ms(step, 1))
    finally:
        cache.release(slot)
    med = {k: statistics.median(v) for k, v in times.items()}
    return {"graph": med["graph"], "binding": med["run"] - med["graph"],
            "inputs": med["step"] - med["run"]}


def measured_step(gen, prompt: list[int], method: str, k: int, max_tokens: int) -> dict:
    """A real generation's per-forward times (ms) from its request metrics, and its tau."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    stream = generate_ids(gen, [prompt], params, method, k if method != "none" else None)[0]
    m = stream.metrics()
    forwards = max(m.target_forwards - 1, 1)  # the prefill's forward is not a decode step
    return {"total": 1000 * m.decode_s / forwards, "score": 1000 * m.score_s / forwards,
            "sample": 1000 * m.sample_s / forwards, "propose": 1000 * m.propose_s / forwards,
            "tau": m.tau, "forwards": forwards}


def decompose(gen, past: int, method: str = PLAIN, k: int = K, max_tokens: int = 64,
              repeats: int = 30, runs: int = 3) -> dict:
    """One row of the table: ms per target forward by part, and ms per output token."""
    rows = 1 if method == "none" else k + 1
    parts = layers(gen, past + max_tokens // 2, rows, repeats)  # the answers' middle
    prompt = synthetic_prompt(gen, past)
    steps = [measured_step(gen, prompt, method, k, max_tokens) for _ in range(runs)]
    best = min(steps, key=lambda s: s["total"])  # the quietest run of the same work
    parts["sample"], parts["propose"] = best["sample"], best["propose"]
    parts["loop"] = best["total"] - best["score"] - best["sample"] - best["propose"]
    parts["score"] = best["score"]
    parts["total"] = best["total"]
    parts["tau"] = best["tau"] or 1.0
    parts["per_token"] = best["total"] / parts["tau"]
    return parts


def _cell(v, width: int = 9, digits: int = 2) -> str:
    return f"{'-':>{width}}" if v is None else f"{v:{width}.{digits}f}"


def table(rows: dict[str, dict]) -> str:
    head = (f"{'configuration':<22}" + "".join(f"{p:>9}" for p in PARTS)
            + f"{'total':>9}{'tau':>6}{'ms/token':>10}")
    lines = [head, "-" * len(head)]
    for name, r in rows.items():
        lines.append(f"{name:<22}" + "".join(_cell(r[p]) for p in PARTS)
                     + f"{r['total']:9.2f}{r['tau']:6.2f}{r['per_token']:10.2f}")
    return "\n".join(lines)


def as_json(rows: dict[str, dict]) -> dict:
    return {name: {k: (float(v) if isinstance(v, (int, float, np.floating)) else v)
                   for k, v in r.items()} for name, r in rows.items()}


def overhead_report(engine: str, pasts: list[int], threads: int | None = None,
                    method: str = "ngram", k: int = K, max_tokens: int = 64,
                    json_out=None, log=None, peers: tuple[str, ...] = ()) -> str:
    """`trt-spec bench --overhead`: the table for plain exact, plain fast and `method` at k
    (every step drafting its k: the policy's gain rules off), after each past (default 64);
    peers: "onnxruntime-genai" adds its plain decoding (the graph, and the rest)."""
    from trt_spec.runtime.generator import Generator
    from trt_spec.tools.bench_output import write_json

    unknown = [p for p in peers if p != "onnxruntime-genai"]
    if unknown:
        raise ValueError(f"--overhead --peers {','.join(unknown)}: only onnxruntime-genai's "
                         "graph can be timed alone here")
    if not isinstance(k, int) or k < 1:
        raise ValueError(f"--num-draft-tokens {k!r}: the decomposition needs one fixed k >= 1")
    pasts = list(pasts) or [64]
    max_len = max(pasts) + max_tokens + k + 16
    configs = {"none, exact": dict(exact_decode=True, method="none"),
               "none, fast": dict(exact_decode=False, method="none"),
               f"{method} k={k}, exact": dict(exact_decode=True, method=method,
                                              num_draft_tokens=k, fallback=False)}
    report = {}
    for past in pasts:
        rows = {}
        for name, options in configs.items():
            if log:
                log(f"past {past}: {name}")
            gen = Generator(engine, threads=threads, max_len=max_len, prefix_cache=False,
                            **options)
            rows[name] = decompose(gen, past, options["method"], k, max_tokens)
        if "onnxruntime-genai" in peers:
            if log:
                log(f"past {past}: onnxruntime-genai")
            rows["onnxruntime-genai"] = ortgenai_row(engine, synthetic_prompt(gen, past),
                                                     max_tokens, threads)
        report[past] = rows
    if json_out:
        write_json(json_out, {str(p): as_json(r) for p, r in report.items()})
    return "\n\n".join(f"past {p} (ms per target forward)\n{table(r)}" for p, r in report.items())


def ortgenai_graph_ms(folder, past: int, threads: int, repeats: int = 30) -> float:
    """onnxruntime-genai's decoder graph alone, as its generator runs it: one new token after
    `past`, each layer's max-length cache buffer bound as both past and present (its
    past_present_share_buffer), in a raw ONNX Runtime session with its thread settings."""
    import json
    from pathlib import Path

    import onnxruntime as ort

    from trt_spec.runtime.backends.ort import make_session

    folder = Path(folder)
    decoder = json.loads((folder / "genai_config.json").read_text())["model"]["decoder"]
    session = make_session(folder / decoder["filename"], threads)  # as ours: same threads
    max_len = past + 16
    shape = (1, decoder["num_key_value_heads"], max_len, decoder["head_size"])
    io, kept = session.io_binding(), []
    names = decoder["inputs"], decoder["outputs"]
    for i in range(decoder["num_hidden_layers"]):
        for kind in ("key", "value"):
            value = ort.OrtValue.ortvalue_from_numpy(np.zeros(shape, np.float32))
            io.bind_ortvalue_input(names[0][f"past_{kind}_names"] % i, value)
            io.bind_ortvalue_output(names[1][f"present_{kind}_names"] % i, value)
            kept.append(value)
    ids = np.array([[1]], np.int64)
    mask = np.ones((1, past + 1), np.int64)
    logits = np.empty((1, 1, decoder.get("vocab_size", 0) or session.get_outputs()[0].shape[-1]),
                      np.float32)
    io.bind_cpu_input(names[0]["input_ids"], ids)
    io.bind_cpu_input(names[0]["attention_mask"], mask)
    io.bind_output(names[1]["logits"], "cpu", 0, np.float32, list(logits.shape),
                   logits.ctypes.data)
    return _median_ms(lambda: session.run_with_iobinding(io), repeats)


def ortgenai_row(engine: str, prompt_ids: list[int], max_tokens: int,
                 threads: int | None, runs: int = 3, repeats: int = 30) -> dict:
    """onnxruntime-genai (the bench peer, on the engine's source model), plain greedy: the
    graph alone, and the rest of its C++ generator loop per token (its binding, sampling and
    loop cannot be told apart from outside)."""
    from trt_spec.runtime.manifest import load_manifest
    from trt_spec.tools.peers import peer_context
    from trt_spec.tools.peers.ortgenai import OrtGenaiPeer

    peer = OrtGenaiPeer()
    ok, reason = peer.available()
    if not ok:
        raise ValueError(f"onnxruntime-genai: {reason}")
    ctx = peer_context(load_manifest(engine, verify="none").data, threads, 4, engine)
    peer.load(ctx)
    try:
        rates = [peer.generate(prompt_ids, max_tokens, 0.0, 0)["tokens_per_s"]
                 for _ in range(runs)]
    finally:
        peer.close()
    past = len(prompt_ids) + max_tokens // 2  # the middle of the measured answers
    graph = ortgenai_graph_ms(peer.folder, past, ctx.threads, repeats)
    total = 1000 / max(rates)  # the quickest run's ms a token
    return {"graph": graph, "binding": None, "inputs": None, "propose": None, "sample": None,
            "loop": total - graph, "score": None, "total": total, "tau": 1.0,
            "per_token": total}
