"""SpecVerify: NumPy reference = the host's rule (runtime/verify.py, plain decoding's token at
every position) = torch op (runtime/device/verify.py, the device loop's) = ORT lowering =
Triton kernel (on CUDA, and under TRITON_INTERPRET=1 on a CPU: `make test-triton`)."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from trt_spec.plugins.spec_verify import (spec_verify_reference, spec_verify_torch)  # noqa: E402
from trt_spec.runtime import race_torch  # noqa: E402
from trt_spec.runtime.sampling import SamplingParams, next_token  # noqa: E402

VOCAB = 40


def params_of(case: dict, b: int) -> SamplingParams:
    """Row b's settings as the host's SamplingParams (its seed as uint64)."""
    return SamplingParams(temperature=float(case["temperature"][b]), top_k=int(case["top_k"][b]),
                          top_p=float(case["top_p"][b]), seed=int(case["seed"][b]) % 2**64)


def plain_tokens(case: dict, b: int) -> list[int]:
    """Plain decoding's token at each of row b's k + 1 positions (runtime/sampling.py)."""
    params = params_of(case, b)
    return [next_token(row.astype(np.float64), params, int(case["position"][b]) + i)
            for i, row in enumerate(case["target_logits"][b])]


def make_case(seed: int, batch: int, k: int, mode: str, temperature: float = 1.0,
              agree: float = 0.0, lens=None, top_k: int = 0, top_p: float = 1.0):
    """Random inputs. mode: "greedy" | "stochastic" | "mixed" (rows alternate). agree: the
    chance that a draft is the target's token there (plain decoding's, which drives
    acceptance); the other drafts differ from it."""
    rng = np.random.default_rng(seed)
    logits = rng.normal(0, 2, (batch, k + 1, VOCAB)).astype(np.float32)
    lens = np.full(batch, k) if lens is None else np.asarray(lens)
    temps = {"greedy": [0.0] * batch, "stochastic": [temperature] * batch,
             "mixed": [0.0 if b % 2 else temperature for b in range(batch)]}[mode]
    case = dict(draft_tokens=np.zeros((batch, k), np.int64), draft_lens=lens.astype(np.int32),
                target_logits=logits,
                seed=rng.integers(-2**63, 2**63 - 1, batch, dtype=np.int64),  # uint64 bits
                position=rng.integers(0, 500, batch).astype(np.int64),
                temperature=np.array(temps, np.float32),
                top_k=np.full(batch, top_k, np.int32), top_p=np.full(batch, top_p, np.float32))
    for b in range(batch):
        target = np.array(plain_tokens(case, b)[:k])
        other = (target + rng.integers(1, VOCAB, k)) % VOCAB
        case["draft_tokens"][b] = np.where(rng.random(k) < agree, target, other)
    return case


CASES = {  # name: make_case kwargs
    "k1_greedy": dict(seed=1, batch=3, k=1, mode="greedy", agree=0.5),
    "all_accepted_greedy": dict(seed=2, batch=4, k=4, mode="greedy", agree=1.0),
    "none_accepted_greedy": dict(seed=3, batch=4, k=4, mode="greedy", agree=0.0),
    "mixed_lens_greedy": dict(seed=4, batch=4, k=5, mode="greedy", agree=0.7, lens=[5, 0, 2, 3]),
    "k1_stochastic": dict(seed=5, batch=3, k=1, mode="stochastic", agree=0.5),
    "stochastic_agree": dict(seed=6, batch=6, k=4, mode="stochastic", agree=0.9,
                             temperature=0.5),
    "stochastic_none": dict(seed=7, batch=4, k=3, mode="stochastic", agree=0.0,
                            temperature=0.1),
    "all_accepted_stochastic": dict(seed=12, batch=4, k=4, mode="stochastic", agree=1.0,
                                    temperature=1.5),
    "mixed_lens_stochastic": dict(seed=8, batch=4, k=5, mode="stochastic", agree=0.6,
                                  lens=[1, 5, 0, 3]),
    "mixed_rows": dict(seed=9, batch=6, k=3, mode="mixed", agree=0.7, lens=[3, 2, 1, 0, 3, 3]),
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
def test_reference_emits_plain_decodings_tokens(name):
    """The op's reference is drafter-invariant: a row emits plain decoding's token at every
    position it reaches (the argmax, or the race of its seed there), and accepts exactly the
    drafts that equal it."""
    case = make_case(**CASES[name])
    accepted, tokens = spec_verify_reference(**case)
    for b in range(len(accepted)):
        plain = plain_tokens(case, b)
        n, d = int(case["draft_lens"][b]), case["draft_tokens"][b]
        a = next((i for i in range(n) if d[i] != plain[i]), n)
        assert accepted[b] == a, (name, b)
        assert tokens[b, :a + 1].tolist() == plain[:a + 1], (name, b)
        assert (tokens[b, a + 1:] == -1).all()


def test_torch_equals_reference():
    """The torch op (the device loop's verify) takes the host's decisions token for token."""
    for name, case in filtered_cases():
        accepted, tokens = spec_verify_reference(**case)
        got_a, got_t = spec_verify_torch(**as_torch(case))
        np.testing.assert_array_equal(got_a.numpy(), accepted, err_msg=name)
        np.testing.assert_array_equal(got_t.numpy(), tokens, err_msg=name)


def test_edge_cases_are_edges():
    """The named cases really hit all-accepted / none-accepted."""
    for name, want in (("all_accepted_greedy", 4), ("none_accepted_greedy", 0),
                       ("stochastic_none", 0), ("all_accepted_stochastic", 4)):
        a, _ = spec_verify_reference(**make_case(**CASES[name]))
        assert (a == want).all(), name


def test_stochastic_sampling_matches_target_distribution():
    """k = 1, drafts drawn from q by the race with the target's noise (a model drafter's
    coupling): the emitted first token is distributed as p (losslessness), over many rows
    (one seed each), and a draft is accepted at least as often as the coupling's bound
    (1 - TV) / (1 + TV) says; checked on the batched torch op."""
    n = 20000
    rng = np.random.default_rng(0)
    logits = rng.normal(0, 1, (1, 2, 8)).astype(np.float32)
    q_logits = logits[:, :1] + rng.normal(0, 0.7, (1, 1, 8)).astype(np.float32)
    seed = torch.arange(n, dtype=torch.int64) * 7919
    position = torch.full((n,), 3, dtype=torch.int64)
    drafts = race_torch.race_logits(torch.from_numpy(q_logits).expand(n, 1, 8), seed,
                                    position[:, None], 8)  # (n, 1)
    case = dict(draft_tokens=drafts, draft_lens=torch.ones(n, dtype=torch.int32),
                target_logits=torch.from_numpy(logits).expand(n, 2, 8), seed=seed,
                position=position, temperature=torch.ones(n), top_k=None, top_p=None)
    accepted, tokens = spec_verify_torch(**case)
    freq = np.bincount(tokens[:, 0].numpy(), minlength=8) / n
    p = np.exp(logits[0, 0]) / np.exp(logits[0, 0]).sum()
    np.testing.assert_allclose(freq, p, atol=0.015)
    q = np.exp(q_logits[0, 0]) / np.exp(q_logits[0, 0]).sum()
    tv = 0.5 * np.abs(p - q).sum()
    assert accepted.double().mean() >= (1 - tv) / (1 + tv) - 0.015, (accepted.double().mean(), tv)


def export_verify(backend: str):
    """The SpecVerify module traced by the dynamo exporter under `backend`'s lowering."""
    from trt_spec.export.onnx_export import export_module
    from trt_spec.plugins.lowering import lowering
    from trt_spec.plugins.spec_verify import INPUTS, OUTPUTS, SpecVerify

    case = as_torch(make_case(seed=0, batch=2, k=3, mode="mixed"))
    b = torch.export.Dim("batch", min=1, max=1024)
    k = torch.export.Dim("num_drafts", min=1, max=64)
    dims = ({0: b, 1: k}, {0: b}, {0: b, 1: k + 1}, {0: b}, {0: b}, {0: b}, {0: b}, {0: b})
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
                   "Add", "Tile", "IsInf", "Or",
                   # the race's noise: the hash in int64 bits, E = -log u, a block's minimum
                   "BitShift", "BitwiseAnd", "BitwiseOr", "BitwiseXor", "Log", "GatherND",
                   "Transpose"}, ops
    # the runtime's session options: where an earlier test made ORT's process-wide thread
    # pool, a session must not ask for threads of its own
    path = tmp_path / "spec_verify.onnx"
    onnx.save(proto, path)
    session = make_session(path, threads=1)
    for name in sorted(CASES):
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
    """The Triton kernel races on its own (the noise's hash in uint64, a running argmax over
    vocabulary blocks; top-k / top-p as sampling_torch's logit mask): its tokens equal the
    reference's and the torch op's, every case under every filter."""
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
