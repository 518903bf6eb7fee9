"""The device loop (runtime/device/loop.py) on the CPU with torch: the same code a GPU runs,
minus the CUDA-graph capture. Greedy output of every method equals the ORT backend's (and
plain greedy), at batch 1 and 3, with and without exact decoding; seeded sampled output of
every method equals the host executor's and plain sampling's token for token, with the host's
drafts and acceptance; the sampled tokens follow the target's distribution; device
verification agrees with runtime/verify.py; the requests it does not cover run on the host
executor, their reason recorded (runtime/executors.py)."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from trt_spec.runtime import race_torch, sampling_torch  # noqa: E402
from trt_spec.runtime.device import prefill  # noqa: E402
from trt_spec.runtime.device import verify as device_verify  # noqa: E402
from trt_spec.export.torch_backend import TorchGraphs  # noqa: E402
from trt_spec.runtime.generator import Generator  # noqa: E402
from trt_spec.runtime.manifest import load_manifest  # noqa: E402
from trt_spec.runtime.methods import Speculation  # noqa: E402
from trt_spec.runtime.race import race  # noqa: E402
from trt_spec.runtime.sampling import SamplingParams, next_token, probs_from_logits  # noqa: E402
from trt_spec.runtime.scheduler import Scheduler, generate_ids

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
    # (without the gain rules, whose timings could skip a weak drafter's every draft)
    gen = torch_gen(engine, executor="device", exact_decode=exact, fallback=False)
    for method in METHODS:
        for k in ((3,) if method == "none" else (1, 3)):
            streams = generate_ids(gen, PROMPTS, GREEDY, method, None if method == "none" else k)
            assert [s.output_ids for s in streams] == ort_outputs["none"], (method, k)
            if method != "none":
                assert sum(s.stats.proposed for s in streams) > 0, method
                assert all(s.stats.accepted <= s.stats.proposed for s in streams)
            assert {s.executor for s in streams} == {"device"}, (method, k)
    # a loop per method, at most MAX_LOOPS kept: idle ones make room
    assert len(gen.device_executor.loops) == 4
    loop = gen.device_executor.loops["eagle3"]
    assert loop.stats["steps"] > 0 and loop.width == (8 if exact else loop.k_max + 1)


def test_same_acceptance_as_the_host_loop(engine):
    """Same drafters, same bookkeeping: the same drafts are proposed and accepted (the host
    loops without their gain rules: every step drafts k; and without the host's prefix
    cache, which the device loop does not keep: a head that starts from another method's
    kept rows re-primes on the rows its request reads)."""
    host = torch_gen(engine, executor="host", fallback=False, prefix_cache=False)
    device = torch_gen(engine, executor="device", fallback=False)
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
    assert s.executor == "device" and s.fallback is None and "ngram" in gen.device_executor.loops
    s = generate_ids(gen, PROMPTS[:1], GREEDY, "suffix", 2)[0]  # a host lookup: uploaded
    assert s.executor == "device" and s.fallback is None
    assert "suffix" in gen.device_executor.loops
    prompt_logprobs = SamplingParams(max_tokens=4, prompt_logprobs=2)
    s = generate_ids(gen, PROMPTS[:1], prompt_logprobs, "none")[0]
    assert s.prompt_logprobs and s.executor == "device" and s.fallback is None
    s = generate_ids(gen, PROMPTS[:1], GREEDY, "mtp", "auto")[0]  # planned on the host
    assert s.executor == "device" and s.metrics().fallback is None
    # ONNX Runtime: the host executor, whatever the setting asks
    s = generate_ids(Generator(engine, executor="device"), PROMPTS[:1], GREEDY)[0]
    assert s.executor == "host" and s.fallback is None
    host = torch_gen(engine, executor="host")
    s = generate_ids(host, PROMPTS[:1], GREEDY, "mtp", 2)[0]
    assert s.executor == "host" and s.fallback is None and host.device_executor is None


def test_metrics_are_reported(engine):
    gen = torch_gen(engine, executor="device", fallback=False)
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
    tokens, accepted = device_verify.verify(drafts, valid, logits, ones, None, None,
                                            torch.ones(3, dtype=torch.bool), zeros, zeros, False)
    assert accepted.tolist() == [3, 1, 0]
    assert tokens.tolist() == [[1, 2, 3, 4], [1, 5, -1, -1], [0, -1, -1, -1]]


@pytest.mark.parametrize("top_k,top_p", [(0, 1.0), (3, 1.0), (0, 0.7), (4, 0.8)])
def test_probs_equal_the_host_rule(top_k, top_p):
    logits = torch.randn(2, 3, 11, generator=torch.Generator().manual_seed(1)) * 2
    t = torch.tensor([0.7, 1.3])
    got = sampling_torch.probs_from_logits(logits, t, torch.tensor([top_k] * 2),
                                           torch.tensor([top_p] * 2))
    for b in range(2):
        want = probs_from_logits(logits[b].numpy(), float(t[b]), top_k, top_p)
        np.testing.assert_allclose(got[b].numpy(), want, atol=1e-6)


@pytest.mark.parametrize("top_k,top_p", [(0, 1.0), (5, 0.9)])
def test_target_tokens_are_the_hosts_race(top_k, top_p):
    """Row by row, the device's token is runtime/sampling.py's next_token (the host loop's
    and plain decoding's) at that seed and output position, on SmolLM2's vocabulary size; a
    drafter's race through a draft vocabulary is the host's race over q placed at its ids."""
    g = torch.Generator().manual_seed(2)
    batch, rows, vocab = 3, 2, 49152
    logits = torch.randn(batch, rows, vocab, generator=g) * 3
    seed = torch.tensor([0, 12345, race_torch.signed(2**64 - 7)])
    position = torch.tensor([[0, 1], [40, 41], [7, 8]])
    temperature = torch.tensor([0.8, 1.0, 1.3])
    greedy = torch.tensor([False, False, True])
    filters = (torch.full((batch,), top_k), torch.full((batch,), top_p)) if top_k else (None,) * 2
    got = device_verify.target_tokens(logits, temperature, *filters, greedy, seed, position)
    for b in range(batch):
        params = SamplingParams(temperature=0.0 if greedy[b] else float(temperature[b]),
                                top_k=top_k, top_p=top_p, seed=int(seed[b]) % 2**64)
        want = [next_token(logits[b, i].numpy(), params, int(position[b, i]))
                for i in range(rows)]
        assert got[b].tolist() == want, b
    # a draft vocabulary: 300 of the target's ids, the race with the target's noise at them
    d2t = torch.randperm(vocab, generator=g)[:300].sort().values
    head = torch.randn(batch, 1, 300, generator=g)
    col = device_verify.target_tokens(head, temperature, None, None, greedy * False, seed,
                                      position[:, :1], ids=d2t, vocab=vocab)
    for b in range(batch):
        q = np.zeros(vocab)
        q[d2t.numpy()] = probs_from_logits(head[b, 0].numpy(), float(temperature[b]))
        assert int(d2t[col[b, 0]]) == race(q, int(seed[b]) % 2**64, int(position[b, 0])), b


@pytest.mark.parametrize("with_q", [False, True])
def test_sampled_tokens_follow_the_target(with_q):
    """The race keeps the target's distribution: the first emitted token's frequencies over
    many rows (one seed each) converge to p (after temperature and top-p), a chi-square test
    at 0.1%; drafts from a model drafter's q, raced with the same noise, are accepted at
    least as often as the coupling's bound (1 - TV) / (1 + TV)."""
    g = torch.Generator().manual_seed(0)
    vocab, k, batch = 6, 2, 40000
    target = torch.randn(1, k + 1, vocab, generator=g).expand(batch, -1, -1)
    temperature, top_p = torch.full((batch,), 0.8), torch.full((batch,), 0.9)
    top_k, greedy = torch.zeros(batch, dtype=torch.long), torch.zeros(batch, dtype=torch.bool)
    seed = torch.randint(-2**62, 2**62, (batch,), generator=g)
    position = torch.randint(0, 1000, (batch,), generator=g)
    p = sampling_torch.probs_from_logits(target[:1], temperature[:1], top_k[:1], top_p[:1])[0]
    cols = torch.arange(k)
    if with_q:  # a drafter's own logits, its drafts raced with the target's noise
        head = (target[:1, :k] + torch.randn(1, k, vocab, generator=g)).expand(batch, -1, -1)
        drafts = device_verify.target_tokens(head, temperature, top_k, top_p, greedy, seed,
                                             position[:, None] + cols)
    else:  # a deterministic drafter proposing the target's likeliest tokens
        drafts = target[:, :k].argmax(-1)
    tokens, accepted = device_verify.verify(
        drafts, torch.ones(batch, k, dtype=torch.bool), target, temperature, top_k, top_p,
        greedy, seed, position)
    counts = torch.bincount(tokens[:, 0], minlength=vocab).double()
    p0 = p[0].double()
    live = p0 > 0
    assert counts[~live].sum() == 0  # top-p's dropped tokens never come
    chi2 = ((counts[live] - batch * p0[live]) ** 2 / (batch * p0[live])).sum()
    assert chi2 < 20.5, (chi2, counts / batch, p0)  # chi-square(<= 5 dof), p = 0.001
    rate = (drafts[:, 0] == tokens[:, 0]).double().mean()
    if with_q:
        q0 = sampling_torch.probs_from_logits(head[:1, :1], temperature[:1], top_k[:1],
                                              top_p[:1])[0, 0].double()
        tv = 0.5 * (p0 - q0).abs().sum()
        assert rate >= (1 - tv) / (1 + tv) - 0.01, (rate, tv)
    else:
        assert abs(rate - p0.max()) < 0.01  # a lookup's draft x: accepted with p(x)
    assert 0 < accepted.double().mean() < k


# (params, the methods run, their k): every method under top-p, and an unfiltered run with a
# seed past 2^63 (int64's sign bit on the device) at k = 1
SAMPLED = [(SamplingParams(max_tokens=16, temperature=0.8, top_p=0.9, seed=3, ignore_eos=True),
            METHODS[1:], 3),
           (SamplingParams(max_tokens=16, temperature=1.0, seed=2**64 - 5, ignore_eos=True),
            ["ngram", "eagle3"], 1)]


def test_seeded_sampling_equals_the_host_loop(engine):
    """Seeded sampled output of every method the device loop runs equals the host loop's
    (Engine) token for token and plain sampling's (the race: the same token at each output
    position whatever was drafted); the model drafters draw with the target's noise, so their
    drafts and acceptance are the host's too, and acceptance is real."""
    host = torch_gen(engine, executor="host", fallback=False, prefix_cache=False)
    device = torch_gen(engine, executor="device", fallback=False)
    accepted = {}
    for params, methods, k in SAMPLED:
        plain = [s.output_ids for s in generate_ids(host, PROMPTS, params, "none")]
        assert [s.output_ids for s in generate_ids(device, PROMPTS, params, "none")] == plain
        for method in methods:
            a = generate_ids(host, PROMPTS, params, method, k)
            b = generate_ids(device, PROMPTS, params, method, k)
            assert [s.output_ids for s in a] == plain, (method, k)
            assert [s.output_ids for s in b] == plain, (method, k, params.temperature)
            assert ([(s.stats.proposed, s.stats.accepted) for s in a]
                    == [(s.stats.proposed, s.stats.accepted) for s in b]), (method, k)
            assert {s.executor for s in b} == {"device"}, (method, k)
            accepted[method] = accepted.get(method, 0) + sum(s.stats.accepted for s in b)
    assert all(accepted[m] > 0 for m in ("vanilla", "mtp", "eagle", "eagle3")), accepted


def test_seeded_sampling_per_stream_and_top_k_1(engine):
    """Each stream races its own seed, whatever it is batched with: a stream's output alone
    equals its output in a batch of three with other seeds; top_k 1 is greedy."""
    gen = torch_gen(engine, executor="device")
    params = [SamplingParams(max_tokens=12, temperature=0.9, seed=s, ignore_eos=True)
              for s in (11, 12, 13)]
    streams = [gen.stream(p, q, Speculation("eagle3", 3)) for p, q in zip(PROMPTS, params)]
    batched = [s.output_ids for s in Scheduler(gen).run(streams)]
    alone = [generate_ids(gen, [p], q, "eagle3", 3)[0].output_ids for p, q in zip(PROMPTS, params)]
    assert batched == alone and len(set(map(tuple, alone))) == 3
    top_k = SamplingParams(max_tokens=12, temperature=1.0, top_k=1, seed=3, ignore_eos=True)
    greedy_like = [s.output_ids for s in generate_ids(gen, PROMPTS, top_k, "vanilla", 2)]
    assert greedy_like == [s.output_ids for s in generate_ids(
        gen, PROMPTS, SamplingParams(max_tokens=12, ignore_eos=True), "none")]


@pytest.mark.parametrize("method,params", [
    ("ngram", GREEDY), ("vanilla", GREEDY), ("mtp", GREEDY), ("eagle3", GREEDY),
    ("eagle", SamplingParams(max_tokens=20, temperature=0.9, top_k=20, top_p=0.9, seed=1)),
    ("mtp", SamplingParams(max_tokens=20, temperature=0.9, min_p=0.1, presence_penalty=1.0,
                           logit_bias={5: 2.0}, seed=1))])
def test_a_step_never_reads_the_device(engine, method, params, monkeypatch):
    """What CUDA-graph capture needs, checked on the CPU: the three phases of a step make no
    host round trip (no .item(), bool(), int(), tolist(), nonzero: each would sync a GPU)."""
    gen = torch_gen(engine, executor="device")
    streams = [gen.stream(p, params, Speculation(method, 3)) for p in PROMPTS]
    loop = gen.device_executor.loop(streams[0])
    for s in streams:
        gen.engine.admit(s, reuse=False)
        gen.device_executor.admit(s, None)
    loop.any_sampled = not params.greedy
    loop.filtered = not params.greedy
    loop.controlled = bool(params.controls)
    prefill.read(loop, [(s, len(s.prompt_ids)) for s in streams])
    prefill.activate(loop, streams)

    def sync(*args, **kwargs):
        raise AssertionError("a host read of a device tensor inside a step")

    for name in ("item", "__bool__", "__int__", "__float__", "tolist", "numpy", "nonzero",
                 "__index__"):
        monkeypatch.setattr(torch.Tensor, name, sync)
    with torch.no_grad():
        out, _ = loop._phases(3, timed=False)
    monkeypatch.undo()
    host = out["host"].numpy()
    assert host.shape == (3, loop.k + 3) and (host[:, -2] <= host[:, -1]).all()  # accepted <= proposed


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
    # a host drafter's drafts are uploaded (runtime/device/host_drafts.py)
    assert executors.fallback_reason(torch_side, Stream(PROMPTS[0], GREEDY, "suffix", 3)) is None
    # auto: the device executor on a CUDA device only; the CPU torch backend asks for it
    assert not executors.device_wanted(torch_gen(engine))
    assert executors.device_wanted(torch_side)
