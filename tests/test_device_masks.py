"""vLLM's masks on the device executor (runtime/device/controls.py, runtime/sampling_torch.py
mask): min_tokens, allowed_token_ids and bad words, through `LLM` on the CPU torch backend.
Each output equals the host executor's (greedy and seeded sampled), on every drafting kind,
and none falls back to the host; the torch twin equals runtime/sampling.py's process_logits
on random logits, drafts and outputs."""

from types import SimpleNamespace

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from trt_spec.runtime.device.controls import DeviceControls  # noqa: E402
from trt_spec.runtime.sampling import SamplingParams, process_logits  # noqa: E402

OPTIONS = dict(max_num_seqs=6, max_model_len=96)
PROMPTS = ["a b c a b c a b", "the cat sat on the mat the cat"]
CASES = [("none", None), ("ngram", 3), ("mtp", 3), ("eagle3", 3), ("suffix", 3)]


@pytest.fixture(scope="module")
def llms(host_and_device, tiny_vocab_engine):
    return host_and_device(tiny_vocab_engine, **OPTIONS)


@pytest.fixture(scope="module")
def plain(llms):
    """The first prompt's greedy output without masks: the masks below are built from it,
    so each changes what greedy decoding emits."""
    out, = llms["host"].generate(PROMPTS[:1], SamplingParams(max_tokens=12, ignore_eos=True),
                                 chat=False)
    return list(out.token_ids)


def masks(plain) -> dict[str, dict]:
    return {
        "allowed_token_ids": dict(allowed_token_ids=tuple(sorted({*range(0, 128, 3),
                                                                  plain[2]}))),
        # a two-token word: its second token after the first (on the output or the drafts)
        "bad_word": dict(bad_words_ids=((plain[3], plain[4]),)),
        "bad_words": dict(bad_words_ids=((plain[0],), (plain[5], plain[6], plain[7]))),
        # plain[1] would end the output at its second token
        "min_tokens": dict(min_tokens=6, stop_token_ids=(plain[1],), ignore_eos=False),
    }


def both(llms, params, method, k):
    return [llms[e].generate(PROMPTS, params, method=method, num_draft_tokens=k, chat=False)
            for e in ("host", "device")]


def on_device(outputs):
    return {(o.metrics.executor, o.metrics.fallback) for o in outputs} == {("device", None)}


@pytest.mark.parametrize("method,k", CASES)
def test_greedy_under_each_mask_equals_the_host_executors(llms, plain, method, k):
    cases = masks(plain)
    cases["combined"] = {key: v for c in cases.values() for key, v in c.items()}
    for name, mask in cases.items():
        params = SamplingParams(**{"max_tokens": 12, "ignore_eos": True, **mask})
        host, device = both(llms, params, method, k)
        assert on_device(device), name
        assert [o.token_ids for o in device] == [o.token_ids for o in host], (name, method)
        if name != "min_tokens":  # the mask changed the output
            assert list(device[0].token_ids) != plain, name


def test_min_tokens_holds_the_end_tokens_back(llms, plain):
    stop = dict(stop_token_ids=(plain[1],), ignore_eos=False, max_tokens=12)
    early, = llms["device"].generate(PROMPTS[:1], SamplingParams(**stop), chat=False)
    assert len(early.token_ids) <= 2  # the stop token ends it
    for method, k in (("none", None), ("mtp", 3)):
        host, device = both(llms, SamplingParams(min_tokens=6, **stop), method, k)
        assert on_device(device)
        assert [o.token_ids for o in device] == [o.token_ids for o in host]
        assert len(device[0].token_ids) >= 6


@pytest.mark.parametrize("method,k", [("none", None), ("eagle3", 3), ("suffix", 3)])
def test_seeded_sampled_under_the_masks_equals_the_host_executors(llms, plain, method, k):
    combined = {key: v for c in masks(plain).values() for key, v in c.items()}
    params = SamplingParams(**{"max_tokens": 10, **combined, "temperature": 0.9, "seed": 5})
    host, device = both(llms, params, method, k)
    assert on_device(device)
    assert [o.token_ids for o in device] == [o.token_ids for o in host]


def random_params(rng, vocab: int) -> SamplingParams:
    words = [tuple(int(t) for t in rng.integers(0, vocab + 2, rng.integers(1, 4)))
             for _ in range(rng.integers(0, 4))]
    return SamplingParams(
        max_tokens=20, min_tokens=int(rng.integers(0, 8)),
        stop_token_ids=tuple(int(t) for t in rng.integers(0, vocab, 3)),
        eos_token_ids=(int(rng.integers(0, vocab)),),
        allowed_token_ids=(tuple(int(t) for t in rng.integers(0, vocab + 3, 9))
                           if rng.random() < 0.5 else ()),
        bad_words_ids=tuple(words))


@pytest.mark.parametrize("seed", range(4))
def test_the_torch_masks_equal_process_logits(seed):
    """DeviceControls' masks (its table, the rows' output tails from seq) on random logits of
    B slots, k drafts each, against the host's process_logits row by row; and a first token
    (no drafts, no output yet)."""
    rng = np.random.default_rng(seed)
    b, k, vocab, length = 5, 3, 12, 40
    # few distinct tokens, so the bad words' heads match often
    seq = torch.from_numpy(rng.integers(0, 4, (b, length)))
    start = torch.from_numpy(rng.integers(1, 6, b))
    n = start + torch.from_numpy(rng.integers(0, 9, b))
    state = SimpleNamespace(seq=seq, n=n, start=start)
    controls = DeviceControls(b, vocab, "cpu", state)
    streams = [SimpleNamespace(params=random_params(rng, vocab), slot=i,
                               prompt_ids=seq[i, :start[i]].tolist()) for i in range(b)]
    for s in streams:
        controls.admit(s)
    logits = torch.from_numpy(rng.normal(size=(b, k + 1, vocab)).astype(np.float32))
    drafts = torch.from_numpy(rng.integers(0, 4, (b, k)))
    ones = torch.ones(b)
    z = controls.apply(logits, 0, b, drafts, ones).numpy()
    first = controls.apply(logits[:, :1], 0, b, None, ones).numpy()
    for i, s in enumerate(streams):
        output = seq[i, start[i]:n[i]].tolist()
        want = process_logits(logits[i].numpy(), s.params, s.prompt_ids, output,
                              drafts[i].tolist())
        np.testing.assert_allclose(z[i], want, rtol=1e-6)
        want = process_logits(logits[i, :1].numpy(), s.params, s.prompt_ids, [])
        np.testing.assert_allclose(first[i], want, rtol=1e-6)
