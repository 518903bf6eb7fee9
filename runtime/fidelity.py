"""Fidelity of one engine to a reference engine (e.g. int4 against fp32), by teacher forcing.

The reference writes a greedy continuation of each prompt; both engines then score the same
prompt + continuation in one forward. Reported: how often their argmax agrees at each
continuation position, and the mean KL(p_ref || p_test) of the next-token distributions.
Comparing by teacher forcing, not by diffing two free-running generations, keeps one early
near-tie from deciding every later position.
"""

from __future__ import annotations

import numpy as np

from trt_spec.runtime.sampling import SamplingParams
from trt_spec.runtime.step_inputs import Request


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def score(gen, ids: list[int], start: int) -> np.ndarray:
    """Logits for positions start-1 .. len(ids)-2 (each predicts ids[i + 1]): [n, vocab]."""
    slot = gen.cache.allocate()
    try:
        out = gen.target.step(gen.cache, [Request(slot, ids, list(range(start - 1, len(ids) - 1)))])
    finally:
        gen.cache.release(slot)
    return out.logits[0]


def fidelity(reference, test, prompts_ids: list[list[int]], new_tokens: int = 64) -> dict:
    params = SamplingParams(max_tokens=new_tokens, ignore_eos=True)
    agree, kls = [], []
    for ids in prompts_ids:
        cont = reference.generate_ids([ids], params)[0].output_ids
        full = ids + cont
        lp_ref = log_softmax(score(reference, full, len(ids)))
        lp_test = log_softmax(score(test, full, len(ids)))
        agree.append(lp_ref.argmax(-1) == lp_test.argmax(-1))
        kls.append((np.exp(lp_ref) * (lp_ref - lp_test)).sum(-1))
    agree, kls = np.concatenate(agree), np.concatenate(kls)
    return {"positions": int(agree.size), "greedy_agreement": float(agree.mean()),
            "mean_kl": float(kls.mean()), "max_kl": float(kls.max())}
