"""The exported ORT graph against the torch module it was traced from."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from trt_spec.export.checkpoint import load_target  # noqa: E402
from trt_spec.export.model import empty_cache  # noqa: E402
from trt_spec.export.quantize import (dequantize_int4, dequantize_int4_residual,  # noqa: E402
                                      quantize_int4, quantize_int4_residual)
from trt_spec.runtime.backends.ort import OrtTarget  # noqa: E402
from trt_spec.runtime.kv_cache import KVCache  # noqa: E402
from trt_spec.runtime.step_inputs import SlotTokens  # noqa: E402


def reference(tiny_hf_dir, ids):
    """Logits, hidden states and Eagle3 features of one full torch pass. ids: list[int]."""
    model, config = load_target(tiny_hf_dir)
    t = len(ids)
    with torch.no_grad():
        out = model(torch.tensor([ids]), torch.arange(t)[None],
                    torch.tensor([t - 1], dtype=torch.int32), torch.tensor([t], dtype=torch.int32),
                    torch.tensor(t, dtype=torch.int32), torch.arange(t)[None],
                    *empty_cache(config, 1, max(t, 16)))
    return [x[0].numpy() for x in out[:3]], config


def open_target(engine, config):
    return OrtTarget(engine / "target.onnx", config.num_layers, config.max_position_embeddings)


IDS = [5, 17, 99, 3, 42, 8, 77, 61, 23, 11, 90, 4, 56, 31]


def test_prefill_decode_verify_rewind(tiny_hf_dir, tiny_engine):
    (logits, hidden, features), config = reference(tiny_hf_dir, IDS)
    target = open_target(tiny_engine, config)
    cache = KVCache(config, slots=1, max_len=64)
    slot = cache.allocate()
    got = []

    def step(tokens, want=()):
        out = target.step(cache, [SlotTokens(slot, tokens, list(range(len(tokens))))], want)
        got.append(out.logits[0])
        return out

    out = step(IDS[:6], want=("hidden_states", "eagle3_features"))  # prefill
    np.testing.assert_allclose(out.rows["hidden_states"][0], hidden[:6], atol=1e-4)
    np.testing.assert_allclose(out.rows["eagle3_features"][0], features[:6], atol=1e-4)
    step(IDS[6:7])  # decode
    step(IDS[7:10])  # 3-token verification after a past
    before = cache.lengths[slot]
    target.step(cache, [SlotTokens(slot, [1, 2, 3], [0])])  # rejected tokens ...
    cache.rewind(slot, before)  # ... discarded by lowering the length
    step(IDS[10:14])
    np.testing.assert_allclose(np.concatenate(got), logits, atol=1e-4)


def test_batched_ragged_step_equals_single(tiny_hf_dir, tiny_engine):
    """Two streams in one forward (different past and new lengths, one idle slot between)."""
    (logits, _, _), config = reference(tiny_hf_dir, IDS)
    target = open_target(tiny_engine, config)
    cache = KVCache(config, slots=3, max_len=64)
    a, idle, b = cache.allocate(), cache.allocate(), cache.allocate()
    target.step(cache, [SlotTokens(a, IDS[:4], [3]), SlotTokens(b, IDS[:7], [6])])
    out = target.step(cache, [SlotTokens(a, IDS[4:7], [0, 1, 2]), SlotTokens(b, IDS[7:8], [0])])
    np.testing.assert_allclose(out.logits[0], logits[4:7], atol=1e-4)
    np.testing.assert_allclose(out.logits[1], logits[7:8], atol=1e-4)
    assert cache.lengths.tolist() == [7, 0, 8]


def test_step_rejects_overflow(tiny_hf_dir, tiny_engine):
    _, config = reference(tiny_hf_dir, IDS[:2])
    target = open_target(tiny_engine, config)
    cache = KVCache(config, slots=1, max_len=8)
    slot = cache.allocate()
    with pytest.raises(ValueError, match="exceed the cache length 8"):
        target.step(cache, [SlotTokens(slot, list(range(3, 12)), [0])])


def test_int4_layout_roundtrip():
    rng = np.random.default_rng(0)
    w = rng.standard_normal((96, 40)).astype(np.float32)  # 3 blocks: odd count of zero points
    wq = dequantize_int4(*quantize_int4(w), 96, 40)
    step = (np.maximum(w.reshape(3, 32, 40).max(1), 0) - np.minimum(w.reshape(3, 32, 40).min(1), 0)) / 15
    assert np.all(np.abs(w - wq).reshape(3, 32, 40) <= step[:, None, :] * 0.5 + 1e-6)


def test_int4_graph_computes_its_dequantized_weights(tiny_hf_dir, tiny_engine_int4):
    """The int4 lowering is exact up to ORT's int8 activation rounding (accuracy level 4): the
    graph matches the torch module whose weights were replaced by their int4+residual (body) /
    int8 (tied embedding and head) dequantized values five times more closely (or better) than
    it matches fp32."""
    from trt_spec.export.quantize import dequantize_int8, quantize_int8

    model, config = load_target(tiny_hf_dir)
    with torch.no_grad():
        fp32 = reference(tiny_hf_dir, IDS)[0][0]
        for name, module in model.named_modules():
            if isinstance(module, torch.nn.Linear):
                w = module.weight.numpy().T  # (K, N)
                wq = dequantize_int4_residual(*quantize_int4_residual(w), *w.shape)
                module.weight.copy_(torch.from_numpy(wq.T.copy()))
        e = model.embed_tokens.weight.numpy()
        eq = dequantize_int8(*quantize_int8(e.T), *e.T.shape).T
        model.embed_tokens.weight.copy_(torch.from_numpy(eq.copy()))
        t = len(IDS)
        want = model(torch.tensor([IDS]), torch.arange(t)[None],
                     torch.tensor([t - 1], dtype=torch.int32), torch.tensor([t], dtype=torch.int32),
                     torch.tensor(t, dtype=torch.int32), torch.arange(t)[None],
                     *empty_cache(config, 1, 16))[0][0].numpy()
    cache = KVCache(config, slots=1, max_len=64)
    slot = cache.allocate()
    got = open_target(tiny_engine_int4, config).step(
        cache, [SlotTokens(slot, IDS, list(range(len(IDS))))]).logits[0]
    lowering_error = np.abs(got - want).mean()
    quantization_error = np.abs(want - fp32).mean()
    # measured: ~0.065 against ~0.64
    assert lowering_error < 0.2 * quantization_error, (lowering_error, quantization_error)
    assert np.mean(got.argmax(-1) == want.argmax(-1)) >= 0.9


def test_cache_is_written_in_place(tiny_hf_dir, tiny_engine):
    """ORT writes the new keys/values into the runtime's own buffers (no copy comes back):
    after a step, the rows of our numpy buffers equal the torch module's present cache."""
    model, config = load_target(tiny_hf_dir)
    with torch.no_grad():
        out = model(torch.tensor([IDS[:5]]), torch.arange(5)[None],
                    torch.tensor([4], dtype=torch.int32), torch.tensor([5], dtype=torch.int32),
                    torch.tensor(16, dtype=torch.int32), torch.tensor([[4]]),
                    *empty_cache(config, 1, 16))
    presents = [p[0, :, :5].numpy() for p in out[3:]]
    cache = KVCache(config, slots=2, max_len=16)
    slot = cache.allocate()
    buffers_before = [b.__array_interface__["data"][0] for b in cache.buffers]
    open_target(tiny_engine, config).step(cache, [SlotTokens(slot, IDS[:5], [4])])
    assert [b.__array_interface__["data"][0] for b in cache.buffers] == buffers_before
    for buffer, present in zip(cache.buffers, presents):
        np.testing.assert_allclose(buffer[slot, :, :5], present, atol=1e-5)
        assert not buffer[slot, :, 5:].any()  # rows past the length untouched
        assert not buffer[1 - slot].any()  # the other slot untouched


def test_long_prefill_then_decode(tiny_hf_dir, tiny_engine):
    """A 200-token prefill (logits of the last position only), then decode and verify steps."""
    ids = [int(x) for x in np.random.default_rng(5).integers(3, 128, 210)]
    (logits, _, _), config = reference(tiny_hf_dir, ids)
    target = open_target(tiny_engine, config)
    cache = KVCache(config, slots=1, max_len=256)
    slot = cache.allocate()
    out = target.step(cache, [SlotTokens(slot, ids[:200], [199])])
    np.testing.assert_allclose(out.logits[0], logits[199:200], atol=1e-4)
    out = target.step(cache, [SlotTokens(slot, ids[200:201], [0])])
    np.testing.assert_allclose(out.logits[0], logits[200:201], atol=1e-4)
    out = target.step(cache, [SlotTokens(slot, ids[201:206], list(range(5)))])
    np.testing.assert_allclose(out.logits[0], logits[201:206], atol=1e-4)


@pytest.mark.parametrize("exact", [True, False])
def test_exact_decode_one_token_steps_equal_verification_rows(tiny_hf_dir, tiny_engine_int4,
                                                              exact):
    """With exact_decode, decoding tokens one by one gives bitwise the logits of verifying them
    in one multi-token step (at batch 1 and 2), and a 1-token step may fill the cache's last
    row (its throwaway row goes to the scratch row). Without it, the one-row attention kernel
    rounds differently (not asserted: whether bits differ depends on the data)."""
    _, config = reference(tiny_hf_dir, IDS[:2])
    target = OrtTarget(tiny_engine_int4 / "target.onnx", config.num_layers,
                       config.max_position_embeddings, exact_decode=exact)
    cache = KVCache(config, slots=2, max_len=len(IDS))
    a, b = cache.allocate(), cache.allocate()
    target.step(cache, [SlotTokens(a, IDS[:6], [5]), SlotTokens(b, IDS[:6], [5])])
    multi = target.step(cache, [SlotTokens(a, IDS[6:], list(range(len(IDS) - 6)))]).logits[0]
    cache.rewind(a, 6)
    one_by_one = []
    for token in IDS[6:]:  # stream a alone, then a and b together: the same bits for a
        out = target.step(cache, [SlotTokens(a, [token], [0]), SlotTokens(b, [token], [0])])
        one_by_one.append(out.logits[0][0])
        assert cache.lengths[a] == cache.lengths[b]
    assert cache.lengths[a] == cache.max_len  # the last step wrote its spare row to scratch
    if exact:
        np.testing.assert_array_equal(np.stack(one_by_one), multi)
    else:
        np.testing.assert_allclose(np.stack(one_by_one), multi, atol=0.5)


def test_exact_decode_one_token_row_of_a_ragged_step(tiny_hf_dir, tiny_engine_int4):
    """A stream with no drafts this step (1 token) verified beside one with drafts (3 tokens)
    gets bitwise the logits it gets decoding alone: ragged rows run with their own query
    length, so its row is padded too."""
    _, config = reference(tiny_hf_dir, IDS[:2])
    target = OrtTarget(tiny_engine_int4 / "target.onnx", config.num_layers,
                       config.max_position_embeddings, exact_decode=True)
    cache = KVCache(config, slots=2, max_len=32)
    a, b = cache.allocate(), cache.allocate()
    target.step(cache, [SlotTokens(a, IDS[:6], [5]), SlotTokens(b, IDS[:4], [3])])
    ragged = target.step(cache, [SlotTokens(a, IDS[6:7], [0]), SlotTokens(b, IDS[4:7], [0, 1, 2])])
    assert cache.lengths.tolist() == [7, 7]
    cache.rewind(a, 6)
    alone = target.step(cache, [SlotTokens(a, IDS[6:7], [0])])
    np.testing.assert_array_equal(ragged.logits[0], alone.logits[0])
    verified = target.step(cache, [SlotTokens(b, IDS[7:9], [0, 1])])  # b goes on normally
    assert verified.logits[0].shape == (2, config.vocab_size) and cache.lengths.tolist() == [7, 9]


@pytest.mark.parametrize("exact", [True, False])
def test_attention_rows_in_graph_equal_runtime_padding(tiny_hf_dir, tiny_engine_int4, exact):
    """Exact decoding inside the graph (only attention runs a second row) gives bitwise the
    logits of padding the request in the runtime (every op runs two rows), plain, ragged and
    into the scratch row; with attention_min_rows 1 the graph is the one-row graph."""
    from trt_spec.runtime.backends.ort import ATTENTION_MIN_ROWS
    from trt_spec.runtime.manifest import load_manifest

    inputs = [i["name"] for i in load_manifest(tiny_engine_int4).graph("target")["inputs"]]
    assert ATTENTION_MIN_ROWS in inputs
    _, config = reference(tiny_hf_dir, IDS[:2])
    in_graph, in_runtime = (OrtTarget(tiny_engine_int4 / "target.onnx", config.num_layers,
                                      config.max_position_embeddings, exact_decode=e)
                            for e in (True, False))  # loaded exact: the rows stay in the graph
    in_graph.exact_decode = exact
    assert in_graph.rows_in_graph
    in_runtime.rows_in_graph = False  # _padded pads every op's rows; the graph is fed 1 row
    in_runtime.step = _feeding_one_row(in_runtime)
    in_runtime.exact_decode = exact  # probed now, as a graph without attention_min_rows
    assert in_runtime.rule.pad_requests == (exact and in_runtime.exactness.holds)
    outs = []
    for target in (in_graph, in_runtime):
        cache = KVCache(config, slots=2, max_len=12)
        a, b = cache.allocate(), cache.allocate()
        steps = [target.step(cache, [SlotTokens(a, IDS[:6], [5]), SlotTokens(b, IDS[:4], [3])])]
        steps.append(target.step(cache, [SlotTokens(a, IDS[6:7], [0]),
                                         SlotTokens(b, IDS[4:7], [0, 1, 2])]))
        for token in IDS[7:12]:  # up to the cache's last row: the junk row goes to scratch
            steps.append(target.step(cache, [SlotTokens(a, [token], [0])]))
        assert cache.lengths.tolist() == [12, 7]
        outs.append([x for s in steps for x in s.logits])
    for got, want in zip(*outs):
        np.testing.assert_array_equal(got, want)


def _feeding_one_row(target):
    """target.step with attention_min_rows = 1 fed (runtime padding does the exact part)."""
    import onnxruntime as ort

    from trt_spec.runtime.backends.ort import ATTENTION_MIN_ROWS

    if ATTENTION_MIN_ROWS not in {i.name for i in target.session.get_inputs()}:
        return target.step  # loaded for fast decoding: the rows pass is out of the graph
    run = target.session.run_with_iobinding

    def run_with_one_row(io: ort.IOBinding, *args):
        io.bind_cpu_input(ATTENTION_MIN_ROWS, np.array(1, np.int32))
        return run(io, *args)

    target.session.run_with_iobinding = run_with_one_row
    return target.step



@pytest.mark.parametrize("exact", [False, True])
def test_decode_one_equals_step(tiny_hf_dir, tiny_engine_int4, exact):
    """Plain decoding's bound-once step (OrtTarget.decode_one) is `step` over one 1-token
    request: bitwise the same logits and cache rows, token after token, in the second of two
    slots (its own views); where `step` would pad (exact decoding's layouts) or the slot is
    full it declines (None) and changes nothing."""
    _, config = load_target(tiny_hf_dir)
    target = OrtTarget(tiny_engine_int4 / "target.onnx", config.num_layers,
                       config.max_position_embeddings, exact_decode=exact)
    caches = [KVCache(config, slots=2, max_len=12) for _ in range(2)]
    slots = [c.allocate() for c in caches]
    slots = [c.allocate() for c in caches]  # slot 1 of each
    for c, s in zip(caches, slots):
        target.step(c, [SlotTokens(s, IDS[:5], [4])])
    rule = target.rule
    bare = not rule.pad_requests and rule.step_min_rows == 1
    for token in IDS[5:12]:
        want = target.step(caches[0], [SlotTokens(slots[1], [token], [0])]).logits[0][0]
        got = target.decode_one(caches[1], slots[1], token)
        if not bare:
            assert got is None and caches[1].lengths[slots[1]] == 5
            return
        assert np.array_equal(got, want)
        assert caches[1].lengths[slots[1]] == caches[0].lengths[slots[0]]
    for a, b in zip(caches[0].buffers, caches[1].buffers):
        assert np.array_equal(a, b)
    assert target.decode_one(caches[1], slots[1], 1) is None  # 12 of 12 rows: step's error
    assert caches[1].lengths[slots[1]] == 12


def test_decode_rows_equals_step(tiny_hf_dir, tiny_engine_int4):
    """A verification's bound-once step (OrtTarget.decode_rows, fast decoding) is `step` over
    one request of T tokens with logits at every row: bitwise the same logits and cache rows,
    for widths 3, 1, 2 in turn (a binding each); a step past the slot's end declines."""
    _, config = load_target(tiny_hf_dir)
    target = OrtTarget(tiny_engine_int4 / "target.onnx", config.num_layers,
                       config.max_position_embeddings)
    caches = [KVCache(config, slots=2, max_len=12) for _ in range(2)]
    slots = [c.allocate() for c in caches]
    slots = [c.allocate() for c in caches]  # slot 1 of each
    for c, s in zip(caches, slots):
        target.step(c, [SlotTokens(s, IDS[:5], [4])])
    for lo, hi in ((5, 8), (8, 9), (9, 11)):
        tokens = list(IDS[lo:hi])
        want = target.step(caches[0], [SlotTokens(slots[1], tokens,
                                                  list(range(len(tokens))))]).logits[0]
        got = target.decode_rows(caches[1], slots[1], tokens)
        assert got.shape == want.shape and np.array_equal(got, want)
        assert caches[1].lengths[slots[1]] == caches[0].lengths[slots[0]] == hi
    for a, b in zip(caches[0].buffers, caches[1].buffers):
        assert np.array_equal(a, b)
    assert target.decode_rows(caches[1], slots[1], list(IDS[:2])) is None  # 11 + 2 > 12
    assert caches[1].lengths[slots[1]] == 11
