"""The device loop (runtime/device/loop.py) on the CPU with torch: the same code a GPU runs,
minus the CUDA-graph capture. Greedy output of every method equals the ORT backend's (and
plain greedy), at batch 1 and 3, with and without exact decoding; the sampled tokens follow
the target's distribution; device verification agrees with runtime/verify.py; the requests
it does not cover run on the host executor, their reason recorded (runtime/executors.py)."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from trt_spec.runtime import sampling_torch  # noqa: E402
from trt_spec.runtime.device import verify as device_verify  # noqa: E402
from trt_spec.export.torch_backend import TorchGraphs  # noqa: E402
from trt_spec.runtime.generator import Generator  # noqa: E402
from trt_spec.runtime.manifest import load_manifest  # noqa: E402
from trt_spec.runtime.sampling import SamplingParams, probs_from_logits  # noqa: E402
from trt_spec.runtime.scheduler import generate_ids

PROMPTS = [[5, 17, 99, 3, 17, 99], [42, 8, 77, 61, 23, 11, 90, 8, 77], [4, 4]]
GREEDY = SamplingParams(max_tokens=20, ignore_eos=True)
METHODS = ["none", "ngram", "vanilla", "mtp", "eagle", "eagle3"]


@pytest.fixture(scope="module")
def engine(tiny_hf_dir, tmp_path_factory):
    from tests.conftest import export_tiny_with_heads

    return export_tiny_with_heads(tiny_hf_dir, tmp_path_factory, "tiny-device", draft_layers=2)


@pytest.fixture(scope="module")
def ort_outputs(engine):
    gen = Generator(engine, max_batch=3, max_len=64)
    return {m: [s.output_ids for s in generate_ids(gen, PROMPTS, GREEDY, m,
                                                       None if m == "none" else 3)]
            for m in METHODS}


def torch_gen(engine, **options):
    manifest = load_manifest(engine)
    graphs = TorchGraphs.from_manifest(manifest, device="cpu", cuda_graphs=False)
    return Generator.from_graphs(manifest, graphs, **{"max_batch": 3, "max_len": 64, **options})


@pytest.mark.parametrize("exact", [True, False])
def test_every_method_equals_ort(engine, ort_outputs, exact):
    gen = torch_gen(engine, executor="device", exact_decode=exact)
    for method in METHODS:
        for k in ((3,) if method == "none" else (1, 3)):
            streams = generate_ids(gen, PROMPTS, GREEDY, method, None if method == "none" else k)
            assert [s.output_ids for s in streams] == ort_outputs["none"], (method, k)
            if method != "none":
                assert sum(s.stats.proposed for s in streams) > 0, method
                assert all(s.stats.accepted <= s.stats.proposed for s in streams)
            assert {s.executor for s in streams} == {"device"}, (method, k)
    # a loop per (method, k), at most MAX_LOOPS kept: idle ones make room
    assert len(gen.device_executor.loops) == 4
    loop = gen.device_executor.loops[("eagle3", 3)]
    assert loop.stats["steps"] > 0 and loop.width == (8 if exact else 4)


def test_same_acceptance_as_the_host_loop(engine):
    """Same drafters, same bookkeeping: the same drafts are proposed and accepted (the host
    loop without its gain rules: the device loop drafts k on every step; and without its
    prefix cache, which the device loop does not keep: a head that starts from another
    method's kept rows re-primes on the rows its request reads)."""
    host = torch_gen(engine, executor="host", fallback=False, prefix_cache=False)
    device = torch_gen(engine, executor="device")
    for method in ("ngram", "vanilla", "mtp", "eagle", "eagle3"):
        a = generate_ids(host, PROMPTS, GREEDY, method, 3)
        b = generate_ids(device, PROMPTS, GREEDY, method, 3)
        assert [s.output_ids for s in a] == [s.output_ids for s in b]
        assert ([(s.stats.proposed, s.stats.accepted, s.stats.target_forwards) for s in a]
                == [(s.stats.proposed, s.stats.accepted, s.stats.target_forwards) for s in b]), \
            method
        # each token's origin (runtime/provenance.py), recorded alike by both loops
        assert [s.sources for s in a] == [s.sources for s in b], method
        assert all(len(s.sources) == len(s.output_ids) for s in b)


def test_batch_1_streams_wait_and_stop(engine, ort_outputs):
    """One slot: the streams run one after another (admission mid-run); stop tokens and
    max_tokens end them where the host loop does."""
    gen = torch_gen(engine, max_batch=1, executor="device")
    streams = generate_ids(gen, PROMPTS, GREEDY, "mtp", 2)
    assert [s.output_ids for s in streams] == ort_outputs["none"]
    out = ort_outputs["none"][0]
    i = next(i for i in range(3, len(out)) if out[i] not in out[:i])  # its first occurrence
    params = SamplingParams(max_tokens=20, stop_token_ids=[out[i]], ignore_eos=True)
    s = generate_ids(gen, PROMPTS[:1], params, "eagle", 3)[0]
    assert s.output_ids == out[:i + 1] and s.finish_reason == "stop"
    assert gen.cache.free_slots == 1


def test_requests_it_does_not_cover_fall_back_to_the_host_with_their_reason(engine):
    gen = torch_gen(engine, executor="device")
    s = generate_ids(gen, PROMPTS[:1], GREEDY, "ngram", 2)[0]
    assert s.executor == "device" and s.fallback is None and ("ngram", 2) in gen.device_executor.loops
    s = generate_ids(gen, PROMPTS[:1], GREEDY, "suffix", 2)[0]  # a host lookup
    assert s.executor == "host" and "drafts on the host" in s.fallback
    assert ("suffix", 2) not in gen.device_executor.loops
    prompt_logprobs = SamplingParams(max_tokens=4, prompt_logprobs=2)
    s = generate_ids(gen, PROMPTS[:1], prompt_logprobs, "none")[0]
    assert s.prompt_logprobs and s.executor == "host" and "prompt logprobs" in s.fallback
    s = generate_ids(gen, PROMPTS[:1], GREEDY, "mtp", "auto")[0]
    assert s.executor == "host" and "auto k" in s.metrics().fallback
    # ONNX Runtime: the host executor, whatever the setting asks
    s = generate_ids(Generator(engine, executor="device"), PROMPTS[:1], GREEDY)[0]
    assert s.executor == "host" and s.fallback is None
    host = torch_gen(engine, executor="host")
    s = generate_ids(host, PROMPTS[:1], GREEDY, "mtp", 2)[0]
    assert s.executor == "host" and s.fallback is None and host.device_executor is None


def test_metrics_are_reported(engine):
    gen = torch_gen(engine, executor="device")
    s = generate_ids(gen, PROMPTS[:1], GREEDY, "eagle3", 3)[0]
    m = s.metrics()
    assert m.completion_tokens == 20 and m.tau and m.tau >= 1
    assert m.propose_s > 0 and m.score_s > 0 and m.sample_s > 0
    assert sum(m.proposed_per_position) and m.target_forwards == s.stats.target_forwards


# --- device verification against runtime/verify.py --------------------------------------------

def test_greedy_verify_cases():
    big = 100.0
    logits = torch.full((3, 4, 6), -big)
    for b, row in enumerate([[1, 2, 3, 4], [1, 5, 3, 4], [0, 2, 3, 4]]):
        for i, t in enumerate(row):
            logits[b, i, t] = big  # the target's argmax at each position
    drafts = torch.tensor([[1, 2, 3], [1, 2, 3], [1, 2, 3]])
    valid = torch.tensor([[True] * 3, [True] * 3, [True, True, False]])
    ones, zeros = torch.ones(3), torch.zeros(3, dtype=torch.long)
    tokens, accepted = device_verify.verify(drafts, valid, None, logits, ones, zeros, ones,
                                            torch.ones(3, dtype=torch.bool), False, False)
    assert accepted.tolist() == [3, 1, 0]
    assert tokens[0].tolist() == [1, 2, 3, 4] and tokens[1, :2].tolist() == [1, 5]
    assert tokens[2, 0].item() == 0


@pytest.mark.parametrize("top_k,top_p", [(0, 1.0), (3, 1.0), (0, 0.7), (4, 0.8)])
def test_probs_equal_the_host_rule(top_k, top_p):
    logits = torch.randn(2, 3, 11, generator=torch.Generator().manual_seed(1)) * 2
    t = torch.tensor([0.7, 1.3])
    got = sampling_torch.probs_from_logits(logits, t, torch.tensor([top_k] * 2),
                                           torch.tensor([top_p] * 2))
    for b in range(2):
        want = probs_from_logits(logits[b].numpy(), float(t[b]), top_k, top_p)
        np.testing.assert_allclose(got[b].numpy(), want, atol=1e-6)


@pytest.mark.parametrize("with_q", [False, True])
def test_sampled_tokens_follow_the_target(with_q):
    """Rejection sampling keeps the target's distribution: the first emitted token's
    frequencies over many rows converge to p (after temperature and top-p)."""
    g = torch.Generator().manual_seed(0)
    vocab, k, batch = 6, 2, 40000
    target = torch.randn(1, k + 1, vocab, generator=g).expand(batch, -1, -1)
    temperature, top_p = torch.full((batch,), 0.8), torch.full((batch,), 0.9)
    p = sampling_torch.probs_from_logits(target[:1], temperature[:1], torch.zeros(1).long(),
                                         top_p[:1])[0, 0]
    if with_q:  # a drafter's own distribution, drafts drawn from it
        q = torch.softmax(torch.randn(k, vocab, generator=g), -1).expand(batch, -1, -1)
        drafts = torch.multinomial(q.reshape(-1, vocab), 1, generator=g).view(batch, k)
    else:  # a deterministic drafter proposing the target's likeliest tokens
        q, drafts = None, target[:, :k].argmax(-1)
    tokens, accepted = device_verify.verify(
        drafts, torch.ones(batch, k, dtype=torch.bool), q, target, temperature,
        torch.zeros(batch, dtype=torch.long), top_p, torch.zeros(batch, dtype=torch.bool),
        True, True, g)
    freq = torch.bincount(tokens[:, 0], minlength=vocab).double() / batch
    assert (freq - p.double()).abs().max() < 0.01, (freq, p)
    assert 0 < accepted.float().mean() < k


def test_sampled_generation_runs_and_is_seeded(engine):
    """One seed draws for the whole batch: the same prompts on the same slots repeat."""
    params = SamplingParams(max_tokens=12, temperature=0.8, top_p=0.9, seed=3, ignore_eos=True)
    a, b = ([s.output_ids for s in generate_ids(torch_gen(engine, executor="device"), 
        PROMPTS, params, "eagle3", 3)] for _ in range(2))
    gen = torch_gen(engine, executor="device")
    assert a == b and all(len(x) == 12 for x in a)
    top_k = SamplingParams(max_tokens=12, temperature=1.0, top_k=1, seed=3, ignore_eos=True)
    greedy_like = [s.output_ids for s in generate_ids(gen, PROMPTS, top_k, "vanilla", 2)]
    assert greedy_like == [s.output_ids for s in generate_ids(gen, 
        PROMPTS, SamplingParams(max_tokens=12, ignore_eos=True), "none")]


@pytest.mark.parametrize("method,params", [
    ("ngram", GREEDY), ("vanilla", GREEDY), ("mtp", GREEDY), ("eagle3", GREEDY),
    ("eagle", SamplingParams(max_tokens=20, temperature=0.9, top_k=20, top_p=0.9, seed=1)),
    ("mtp", SamplingParams(max_tokens=20, temperature=0.9, min_p=0.1, presence_penalty=1.0,
                           logit_bias={5: 2.0}, seed=1))])
def test_a_step_never_reads_the_device(engine, method, params, monkeypatch):
    """What CUDA-graph capture needs, checked on the CPU: the three phases of a step make no
    host round trip (no .item(), bool(), int(), tolist(), nonzero: each would sync a GPU)."""
    gen = torch_gen(engine, executor="device")
    streams = [gen.stream(p, params, method, 3) for p in PROMPTS]
    loop = gen.device_executor.loop(streams[0])
    for s in streams:
        gen.engine.admit(s, reuse=False)
    loop.any_sampled = not params.greedy
    loop.filtered = not params.greedy
    loop.controlled = bool(params.controls)
    loop.admit(streams)

    def sync(*args, **kwargs):
        raise AssertionError("a host read of a device tensor inside a step")

    for name in ("item", "__bool__", "__int__", "__float__", "tolist", "numpy", "nonzero",
                 "__index__"):
        monkeypatch.setattr(torch.Tensor, name, sync)
    with torch.no_grad():
        out, _ = loop._phases(3, timed=False)
    monkeypatch.undo()
    host = out["host"].numpy()
    assert host.shape == (3, 3 + 3) and (host[:, -2] <= host[:, -1]).all()  # accepted <= proposed


def test_half_precision_weights(engine, ort_outputs):
    """dtype="bfloat16": weights, caches and drafter rows in bf16 (logits verified in fp32);
    greedy output is then not the fp32 reference's, but stays lossless against its own plain
    decoding at the same shape (exact decoding)."""
    manifest = load_manifest(engine)
    graphs = TorchGraphs.from_manifest(manifest, device="cpu", cuda_graphs=False,
                                       dtype="bfloat16")
    assert graphs.modules["target"].embed_tokens.weight.dtype == torch.bfloat16
    gen = Generator.from_graphs(manifest, graphs, max_batch=3, max_len=64, executor="device")
    plain = [s.output_ids for s in generate_ids(gen, PROMPTS, GREEDY, "none")]
    assert [s.output_ids for s in generate_ids(gen, PROMPTS, GREEDY, "eagle3", 3)] == plain
    agree = np.mean([a == b for x, y in zip(plain, ort_outputs["none"]) for a, b in zip(x, y)])
    assert agree > 0.3, agree  # a tiny random model in bf16: near-ties flip, not everything


def test_the_device_executor_runs_where_the_backend_declares_a_device_runner(engine):
    """The device executor's contract is declared (backends/base.py DeviceRunner,
    DeviceGraphs): the torch-cuda backend's target and graphs declare it, ONNX Runtime's do
    not, and runtime/executors.py says so rather than probing attributes."""
    from trt_spec.runtime import executors
    from trt_spec.runtime.backends.base import DeviceGraphs, DeviceRunner
    from trt_spec.runtime.stream import Stream

    stream = Stream(PROMPTS[0], GREEDY, "mtp", 3)
    torch_side = torch_gen(engine, executor="device")
    assert isinstance(torch_side.target, DeviceRunner)
    assert isinstance(torch_side.graphs, DeviceGraphs)
    assert executors.fallback_reason(torch_side, stream) is None
    ort_side = Generator(engine, max_batch=3, max_len=64)
    assert not isinstance(ort_side.target, DeviceRunner)
    assert executors.fallback_reason(ort_side, stream) == "the ort backend has no device runner"
    assert "drafts on the host" in executors.fallback_reason(
        torch_side, Stream(PROMPTS[0], GREEDY, "suffix", 3))
    # auto: the device executor on a CUDA device only; the CPU torch backend asks for it
    assert not executors.device_wanted(torch_gen(engine))
    assert executors.device_wanted(torch_side)
