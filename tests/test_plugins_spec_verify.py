"""SpecVerify: NumPy reference = runtime/verify.py's decisions = torch op = ORT lowering
(= Triton kernel where CUDA and triton exist)."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from trt_spec.plugins.spec_verify import (spec_verify_reference, spec_verify_torch)  # noqa: E402
from trt_spec.runtime.verify import greedy_verify, stochastic_verify  # noqa: E402
from trt_spec.runtime.sampling import SamplingParams  # noqa: E402

VOCAB = 40


def make_case(seed: int, batch: int, k: int, mode: str, temperature: float = 1.0,
              agree: float = 0.0, lens=None, full_q: bool = True, top_k: int = 0,
              top_p: float = 1.0):
    """Random inputs. mode: "greedy" | "stochastic" | "mixed" (rows alternate). agree: the
    chance that a draft is the target's argmax (drives acceptance)."""
    rng = np.random.default_rng(seed)
    logits = rng.normal(0, 2, (batch, k + 1, VOCAB)).astype(np.float32)
    drafts = rng.integers(0, VOCAB, (batch, k))
    take = rng.random((batch, k)) < agree
    drafts = np.where(take, logits[:, :k].argmax(-1), drafts)
    q = rng.dirichlet(np.ones(VOCAB) * 0.3, (batch, k)).astype(np.float32)
    if not full_q:
        q = np.ones((batch, k, 1), np.float32)
    lens = np.full(batch, k) if lens is None else np.asarray(lens)
    temps = {"greedy": [0.0] * batch, "stochastic": [temperature] * batch,
             "mixed": [0.0 if b % 2 else temperature for b in range(batch)]}[mode]
    return dict(draft_tokens=drafts.astype(np.int64), draft_lens=lens.astype(np.int32),
                target_logits=logits, draft_probs=q,
                uniforms=rng.random((batch, k + 1)).astype(np.float32),
                temperature=np.array(temps, np.float32),
                top_k=np.full(batch, top_k, np.int32), top_p=np.full(batch, top_p, np.float32))


CASES = {  # name: make_case kwargs
    "k1_greedy": dict(seed=1, batch=3, k=1, mode="greedy", agree=0.5),
    "all_accepted_greedy": dict(seed=2, batch=4, k=4, mode="greedy", agree=1.0),
    "none_accepted_greedy": dict(seed=3, batch=4, k=4, mode="greedy", agree=0.0),
    "mixed_lens_greedy": dict(seed=4, batch=4, k=5, mode="greedy", agree=0.7, lens=[5, 0, 2, 3]),
    "k1_stochastic": dict(seed=5, batch=3, k=1, mode="stochastic"),
    "stochastic_agree": dict(seed=6, batch=6, k=4, mode="stochastic", agree=0.9,
                             temperature=0.5),
    "stochastic_none": dict(seed=7, batch=4, k=3, mode="stochastic", agree=0.0,
                            temperature=0.1),
    "mixed_lens_stochastic": dict(seed=8, batch=4, k=5, mode="stochastic", agree=0.6,
                                  lens=[1, 5, 0, 3]),
    "mixed_rows": dict(seed=9, batch=6, k=3, mode="mixed", agree=0.7, lens=[3, 2, 1, 0, 3, 3]),
    "one_hot_q": dict(seed=10, batch=5, k=4, mode="stochastic", agree=0.8, full_q=False),
    "top_k_top_p": dict(seed=11, batch=5, k=4, mode="stochastic", agree=0.8, top_k=5,
                        top_p=0.8),
}


# every stochastic case again under these top-k / top-p settings (VOCAB + 1: top-k off)
FILTERS = ({}, {"top_k": 3}, {"top_p": 0.6}, {"top_k": 7, "top_p": 0.9}, {"top_k": VOCAB + 1})


def filtered_cases():
    """(name, case) for every case, then every stochastic one under each of FILTERS."""
    for name in sorted(CASES):
        for extra in FILTERS if CASES[name]["mode"] != "greedy" else FILTERS[:1]:
            yield f"{name} {extra}", make_case(**{**CASES[name], **extra})


def as_torch(case: dict) -> dict:
    return {k: torch.from_numpy(np.asarray(v)) for k, v in case.items()}


@pytest.mark.parametrize("name", sorted(CASES))
def test_reference_equals_sampler(name):
    """The op's reference takes the sampler's decisions: uniforms = the sampler's rng draws."""
    case = make_case(**CASES[name])
    batch, k = case["draft_tokens"].shape
    seeds = range(100, 100 + batch)
    uniforms = np.stack([np.random.default_rng(s).random(k + 1) for s in seeds])
    lens = case["draft_lens"]
    full_q = case["draft_probs"].shape[-1] != 1
    params = [SamplingParams(temperature=float(t), top_k=int(tk), top_p=float(tp))
              for t, tk, tp in zip(case["temperature"], case["top_k"], case["top_p"])]
    # the host's Leviathan rule (the device loop's; the host loop races, runtime/race.py)
    want = [greedy_verify(case["draft_tokens"][b, :lens[b]], case["target_logits"][b, :lens[b] + 1])
            if params[b].greedy else
            stochastic_verify(case["draft_tokens"][b, :lens[b]],
                              case["draft_probs"][b, :lens[b]].astype(np.float64) if full_q
                              else None,
                              case["target_logits"][b, :lens[b] + 1], params[b],
                              np.random.default_rng(seeds[b]))
            for b in range(batch)]
    accepted, tokens = spec_verify_reference(**{**case, "uniforms": uniforms})
    np.testing.assert_array_equal(accepted, [a for a, _ in want])
    for b, (_, emitted) in enumerate(want):
        np.testing.assert_array_equal(tokens[b, :len(emitted)], emitted)
        assert (tokens[b, len(emitted):] == -1).all()


def test_torch_equals_reference():
    for name, case in filtered_cases():
        accepted, tokens = spec_verify_reference(**case)
        got_a, got_t = spec_verify_torch(**as_torch(case))
        np.testing.assert_array_equal(got_a.numpy(), accepted, err_msg=name)
        np.testing.assert_array_equal(got_t.numpy(), tokens, err_msg=name)


def test_edge_cases_are_edges():
    """The named cases really hit all-accepted / none-accepted."""
    a, _ = spec_verify_reference(**make_case(**CASES["all_accepted_greedy"]))
    assert (a == 4).all()
    a, _ = spec_verify_reference(**make_case(**CASES["none_accepted_greedy"]))
    assert (a == 0).all()
    a, _ = spec_verify_reference(**make_case(**CASES["stochastic_none"]))
    assert (a == 0).all()


def test_stochastic_sampling_matches_target_distribution():
    """k = 1, drafts sampled from q: the emitted first token is distributed as p
    (losslessness), over many rows; checked on the batched torch op."""
    n = 20000
    rng = np.random.default_rng(0)
    logits = rng.normal(0, 1, (1, 2, 8)).astype(np.float32)
    q = rng.dirichlet(np.ones(8), (1, 1)).astype(np.float32)
    q64 = q[0, 0].astype(np.float64)
    drafts = rng.choice(8, (n, 1), p=q64 / q64.sum())
    case = dict(draft_tokens=drafts, draft_lens=np.ones(n, np.int32),
                target_logits=np.repeat(logits, n, 0), draft_probs=np.repeat(q, n, 0),
                uniforms=rng.random((n, 2)).astype(np.float32),
                temperature=np.ones(n, np.float32), top_k=np.zeros(n, np.int32),
                top_p=np.ones(n, np.float32))
    _, tokens = spec_verify_torch(**as_torch(case))
    freq = np.bincount(tokens[:, 0].numpy(), minlength=8) / n
    p = np.exp(logits[0, 0]) / np.exp(logits[0, 0]).sum()
    np.testing.assert_allclose(freq, p, atol=0.015)


def export_verify(backend: str):
    """The SpecVerify module traced by the dynamo exporter under `backend`'s lowering."""
    from trt_spec.export.onnx_export import export_module
    from trt_spec.plugins.lowering import lowering
    from trt_spec.plugins.spec_verify import INPUTS, OUTPUTS, SpecVerify

    case = as_torch(make_case(seed=0, batch=2, k=3, mode="mixed"))
    b = torch.export.Dim("batch", min=1, max=1024)
    k = torch.export.Dim("num_drafts", min=1, max=64)
    dims = ({0: b, 1: k}, {0: b}, {0: b, 1: k + 1}, {0: b, 1: k}, {0: b, 1: k + 1}, {0: b},
            {0: b}, {0: b})
    with lowering(backend):
        proto = export_module(SpecVerify(), tuple(case[n] for n in INPUTS), dims,
                              [{"name": n} for n in INPUTS], [{"name": n} for n in OUTPUTS])
    return proto, INPUTS


def ort_lowering():
    return export_verify("ort")


def test_ort_lowering_equals_reference(tmp_path):
    import onnx

    from trt_spec.runtime.backends.ort import make_session

    proto, names = ort_lowering()
    onnx.checker.check_model(proto)
    ops = {n.op_type for n in proto.graph.node}
    assert ops <= {"ArgMax", "Softmax", "TopK", "GatherElements", "CumSum", "ScatterElements",
                   "Where", "Less", "Equal", "LessOrEqual", "Not", "And", "Cast", "Div", "Mul",
                   "Sub", "Max", "Min", "Clip", "ReduceSum", "Concat", "Expand", "Unsqueeze",
                   "Squeeze", "Reshape", "Range", "Shape", "Gather", "Slice", "Greater",
                   "OneHot", "ConstantOfShape", "Constant", "Sort", "Identity", "Neg",
                   "Add", "Tile", "IsInf", "Or"}, ops
    # the runtime's session options: where an earlier test made ORT's process-wide thread
    # pool, a session must not ask for threads of its own
    path = tmp_path / "spec_verify.onnx"
    onnx.save(proto, path)
    session = make_session(path, threads=1)
    for name in sorted(CASES):
        if not CASES[name].get("full_q", True):
            continue  # the traced graph has a full-q draft_probs input
        case = make_case(**CASES[name])
        accepted, tokens = spec_verify_reference(**case)
        got_a, got_t = session.run(None, {n: np.asarray(case[n]) for n in names})
        np.testing.assert_array_equal(got_a, accepted, err_msg=name)
        np.testing.assert_array_equal(got_t, tokens, err_msg=name)


def cuda_triton() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return torch.cuda.is_available()


@pytest.mark.skipif(not cuda_triton(), reason="needs CUDA and triton")
def test_triton_equals_reference_and_torch():
    """The Triton kernel keeps its own sampler (softmax and inverse CDF over vocabulary
    blocks; top-k / top-p as sampling_torch's logit mask): its tokens equal the reference's
    and the torch op's, every case under every filter."""
    from trt_spec.plugins.spec_verify import spec_verify_triton

    for name, case in filtered_cases():
        accepted, tokens = spec_verify_reference(**case)
        ta, tt = spec_verify_torch(**as_torch(case))
        got_a, got_t = spec_verify_triton(**{k: v.cuda() for k, v in as_torch(case).items()})
        for got, want in ((got_a, accepted), (got_t, tokens), (got_a, ta), (got_t, tt)):
            np.testing.assert_array_equal(got.cpu().numpy(), np.asarray(want), err_msg=name)


INTERPRETED = """
import numpy as np, torch
from tests.test_plugins_spec_verify import as_torch, filtered_cases
from trt_spec.plugins.spec_verify import (spec_verify_reference, spec_verify_torch,
                                          spec_verify_triton)
for name, case in filtered_cases():
    a, t = spec_verify_reference(**case)
    ta, tt = spec_verify_torch(**as_torch(case))
    ga, gt = spec_verify_triton(**as_torch(case), block_v=16)  # several V blocks
    for got, want in ((ga, a), (gt, t), (ga, ta), (gt, tt)):
        np.testing.assert_array_equal(got.numpy(), np.asarray(want), err_msg=name)
print("ok")
"""


def test_triton_kernel_interpreted():
    """The Triton kernel run by triton's CPU interpreter (TRITON_INTERPRET=1), where triton is
    installed: the same kernel the GPU runs, checked without one."""
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    done = subprocess.run([sys.executable, "-c", INTERPRETED], env=env, cwd=root,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "ok" in done.stdout, done.stderr[-3000:]
