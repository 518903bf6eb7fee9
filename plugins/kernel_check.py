"""GPU check of the plugins (called by scripts/gpu_check.py; under 30 s on an H200).

`run(out)` checks the Triton SpecVerify kernel against the NumPy reference on random inputs
(several batch / k / vocab shapes; greedy, stochastic, mixed rows; top-k / top-p; mixed
draft lengths) and times it against `spec_verify_torch` on the same device. It returns data
and prints nothing. Where CUDA or triton is missing it records why and returns.

Agreement: greedy rows must match exactly; stochastic rows race the same noise in float64
everywhere, but the GPU's log is another libm's (within an ulp of NumPy's), which can flip a
near-tie, so a stochastic case passes with at most 1% of its rows different (the count is
reported; expected 0).
"""

from __future__ import annotations

import time

import numpy as np

# (batch, k, vocab, mode, top_k, top_p, mixed_lens)
CASES = (
    (1, 1, 49152, "greedy", 0, 1.0, False),
    (64, 4, 49152, "greedy", 0, 1.0, True),
    (64, 4, 49152, "stochastic", 0, 1.0, True),
    (32, 8, 32000, "mixed", 0, 1.0, True),
    (16, 4, 49152, "stochastic", 0, 1.0, False),
    (16, 3, 49152, "stochastic", 50, 0.9, False),
    (5, 2, 1000, "mixed", 0, 1.0, True),
)
TIMED = ((64, 4, 49152), (256, 4, 49152), (8, 8, 151936))  # (batch, k, vocab), stochastic


def random_case(rng: np.random.Generator, batch: int, k: int, vocab: int, mode: str,
                top_k: int, top_p: float, mixed_lens: bool) -> dict:
    """NumPy inputs of SpecVerify. About 70% of drafts are the target's argmax (which a
    stochastic row at temperature 0.8 over logits of spread 3 often races to), so acceptance
    lengths vary."""
    logits = rng.normal(0, 3, (batch, k + 1, vocab)).astype(np.float32)
    drafts = rng.integers(0, vocab, (batch, k))
    drafts = np.where(rng.random((batch, k)) < 0.7, logits[:, :k].argmax(-1), drafts)
    temps = {"greedy": np.zeros(batch), "stochastic": np.full(batch, 0.8),
             "mixed": np.where(np.arange(batch) % 2 == 0, 0.0, 0.8)}[mode]
    lens = rng.integers(0, k + 1, batch) if mixed_lens else np.full(batch, k)
    return dict(draft_tokens=drafts.astype(np.int64), draft_lens=lens.astype(np.int32),
                target_logits=logits,
                seed=rng.integers(-2**63, 2**63 - 1, batch, dtype=np.int64),
                position=rng.integers(0, 4096, batch).astype(np.int64),
                temperature=temps.astype(np.float32),
                top_k=np.full(batch, top_k, np.int32), top_p=np.full(batch, top_p, np.float32))


def check_case(case: dict, device: str) -> dict:
    import torch

    from trt_spec.plugins.spec_verify import spec_verify_reference, spec_verify_triton

    accepted, tokens = spec_verify_reference(**case)
    ins = {k: torch.from_numpy(v).to(device) for k, v in case.items()}
    if case["top_k"].max() == 0 and case["top_p"].min() == 1.0:
        ins["top_k"] = ins["top_p"] = None  # the kernel's unmasked path
    got_a, got_t = spec_verify_triton(**ins)
    got_a, got_t = got_a.cpu().numpy(), got_t.cpu().numpy()
    differ = (got_a != accepted) | (got_t != tokens).any(-1)
    greedy = case["temperature"] == 0
    return {"rows": int(len(accepted)), "greedy_rows_differ": int((differ & greedy).sum()),
            "stochastic_rows_differ": int((differ & ~greedy).sum()),
            "mean_accepted": float(accepted.mean()),
            "ok": bool((differ & greedy).sum() == 0
                       and (differ & ~greedy).sum() <= max(1, 0.01 * (~greedy).sum()))}


def time_us(fn, iters: int = 20) -> float:
    import torch

    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / iters * 1e6


def run(out: dict | None = None, device: str = "cuda") -> dict:
    """Fills and returns `out["spec_verify"]`: {"cases": [...], "timing": [...], "ok": bool}
    (or {"skipped": reason})."""
    out = {} if out is None else out
    result = out.setdefault("spec_verify", {})
    try:
        import torch
        import triton  # noqa: F401
    except ImportError as e:
        result["skipped"] = f"needs torch and triton: {e}"
        return out
    if device == "cuda" and not torch.cuda.is_available():
        result["skipped"] = "no CUDA device"
        return out
    from trt_spec.plugins.spec_verify import spec_verify_torch, spec_verify_triton

    t0 = time.perf_counter()
    rng = np.random.default_rng(0)
    cases = []
    for spec in CASES:
        batch, k, vocab, mode, top_k, top_p, mixed = spec
        entry = {"batch": batch, "k": k, "vocab": vocab, "mode": mode, "top_k": top_k,
                 "top_p": top_p, "mixed_lens": mixed}
        try:
            entry.update(check_case(random_case(rng, *spec), device))
        except Exception as e:  # reported, not raised: the other checks still run
            entry.update(ok=False, error=f"{type(e).__name__}: {e}")
        cases.append(entry)
    result["cases"] = cases

    timing = []
    if device == "cuda":
        for batch, k, vocab in TIMED:
            case = random_case(rng, batch, k, vocab, "stochastic", 0, 1.0, False)
            ins = {n: torch.from_numpy(v).to(device) for n, v in case.items()}
            ins["top_k"] = ins["top_p"] = None
            greedy = {**ins, "temperature": torch.zeros_like(ins["temperature"])}
            timing.append({
                "batch": batch, "k": k, "vocab": vocab,
                "triton_stochastic_us": time_us(lambda: spec_verify_triton(**ins)),
                "torch_stochastic_us": time_us(lambda: spec_verify_torch(**ins)),
                "triton_greedy_us": time_us(lambda: spec_verify_triton(**greedy)),
                "torch_greedy_us": time_us(lambda: spec_verify_torch(**greedy)),
            })
    result["timing"] = timing
    result["ok"] = all(c["ok"] for c in cases)
    result["seconds"] = round(time.perf_counter() - t0, 2)
    return out
