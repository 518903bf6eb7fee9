"""TRT-lowered graphs on the CPU: `trt-spec export --lower-for trt` writes graphs that pass
onnx.checker and, run by onnx.reference with plugins/reference_ops.py standing in for
TensorRT's ops, equal the torch reference (prefill, decode, verify after a past)."""

from __future__ import annotations

import copy
import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
onnx = pytest.importorskip("onnx")

from onnx.reference import ReferenceEvaluator  # noqa: E402

from trt_spec.export.checkpoint import load_target  # noqa: E402
from trt_spec.export.model import TargetScorer, empty_cache  # noqa: E402
from trt_spec.plugins.attention import Heads, attention_numpy, attention_reference  # noqa: E402
from trt_spec.plugins.reference_ops import REFERENCE_OPS  # noqa: E402
from trt_spec.plugins.spec_verify import spec_verify_reference  # noqa: E402

MAX_LEN = 16


@pytest.fixture(scope="module")
def trt_engine(tiny_hf_dir, tmp_path_factory):
    """The tiny target exported with --lower-for trt --precision fp32 (target + score)."""
    from trt_spec.export.config import ExportConfig
    from trt_spec.export.pipeline import export_model

    return export_model(ExportConfig(str(tiny_hf_dir),
                                     tmp_path_factory.mktemp("engines") / "tiny-trt", "fp32",
                                     lower_for="trt"))


@pytest.fixture(scope="module")
def torch_target(tiny_hf_dir):
    model, config = load_target(tiny_hf_dir)
    return model.eval(), config


def graph(engine, name):
    proto = onnx.load(str(engine / f"{name}.onnx"))  # external data loaded from beside it
    onnx.checker.check_model(proto)
    return proto, ReferenceEvaluator(proto, new_ops=REFERENCE_OPS)


def test_attention_numpy_equals_torch_with_and_without_mask():
    rng = np.random.default_rng(0)
    nh, kvh, hd, batch, t, max_len = 4, 2, 8, 2, 3, 10
    qkv = rng.normal(size=(batch, t, (nh + 2 * kvh) * hd)).astype(np.float32)
    past_k = rng.normal(size=(batch, kvh, max_len, hd)).astype(np.float32)
    past_v = rng.normal(size=(batch, kvh, max_len, hd)).astype(np.float32)
    seqlens_k = np.array([6, 3], np.int32)  # 7 and 4 tokens after this step
    q_lens = np.array([3, 2], np.int32)  # row 1: one padding token
    pos = np.array([[4, 5, 6], [2, 3, 0]])
    angles = np.outer(np.arange(32), 1.0 / 10000 ** (np.arange(0, hd, 2) / hd))
    cos, sin = np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)
    tree = rng.random((batch, t, max_len)) < 0.6
    tree[:, :, 0] = True  # every query sees at least the first token
    for mask, window in ((None, 0), (tree, 0), (None, 3), (tree, 3)):  # 3: a sliding window
        want = attention_reference(*map(torch.from_numpy, (qkv, past_k, past_v, seqlens_k, q_lens,
                                                          pos, cos, sin)),
                                   Heads(nh, kvh, window),
                                   None if mask is None else torch.from_numpy(mask))
        got = attention_numpy(qkv, past_k, past_v, seqlens_k, q_lens, pos, cos, sin,
                              Heads(nh, kvh, window), mask)
        for w, g in zip(want, got):
            np.testing.assert_allclose(g, w.numpy(), atol=1e-5)


def test_manifest_records_trt_graphs(trt_engine):
    manifest = json.loads((trt_engine / "manifest.json").read_text())
    assert manifest["source"]["backend"] == "trt"
    target, score = manifest["graphs"]["target"], manifest["graphs"]["score"]
    for entry in (target, score):
        assert entry["backend"] == "trt" and entry["precision"] == "fp32"
        assert entry["dynamic_axes"]["input_ids"] == {"0": "batch", "1": "new_tokens"}
        assert entry["dynamic_axes"]["past_key_values.0.key"] == {"0": "batch", "2": "max_len"}
    assert target["custom_ops"] == ["trt::TRT_Attention", "trt::TRT_KVCacheUpdate"]
    assert target["plugins"] == []
    assert score["plugins"] == ["trt_spec::SpecVerify"]
    assert [o["name"] for o in score["outputs"][:2]] == ["num_accepted", "tokens"]


def step_feeds(config, ids_rows, past_lens, caches):
    """Right-padded step inputs for rows of new tokens after `past_lens` cached tokens."""
    batch, t = len(ids_rows), max(len(r) for r in ids_rows)
    ids = np.zeros((batch, t), np.int64)
    pos = np.zeros((batch, t), np.int64)
    for b, row in enumerate(ids_rows):
        ids[b, :len(row)] = row
        pos[b, :len(row)] = np.arange(past_lens[b], past_lens[b] + len(row))
    q = np.array([len(r) for r in ids_rows], np.int32)
    seqlens = (np.asarray(past_lens) + q - 1).astype(np.int32)
    return {"input_ids": ids, "position_ids": pos, "seqlens_k": seqlens, "query_seqlens": q,
            "total_sequence_length": np.array(MAX_LEN, np.int32),
            **{f"past_key_values.{i // 2}.{'key' if i % 2 == 0 else 'value'}": c
               for i, c in enumerate(caches)}}


def run_torch(module, feeds, extra=()):
    names = ["input_ids", "position_ids", "seqlens_k", "query_seqlens", "total_sequence_length"]
    args = [torch.from_numpy(np.asarray(feeds[n])) for n in names + list(extra)]
    past = [torch.from_numpy(v) for k, v in feeds.items() if k.startswith("past_key_values.")]
    with torch.no_grad():
        return [x.numpy() for x in module(*args, *past)]


def steps_match_torch(session, proto, model, config, seqs, steps, max_len: int,
                      total: int | None = None) -> None:
    """Rows `seqs` stepped through the graph's `session` and the torch `model`, each with its
    own caches of `max_len` rows: steps are (start, n) slices of every row; logits equal
    (1e-4) at every step. total: the graph's total_sequence_length (None: step_feeds')."""
    from trt_spec.export.model import empty_cache

    caches = [c.numpy() for c in empty_cache(config, len(seqs), max_len)]
    want_caches = [c.copy() for c in caches]
    lengths = [0] * len(seqs)
    names = [o.name for o in proto.graph.output]
    for start, n in steps:
        rows = [s[start:start + n] for s in seqs]
        feeds = step_feeds(config, rows, lengths, caches)
        if total is not None:
            feeds["total_sequence_length"] = np.array(total, np.int32)
        feeds["logits_index"] = np.tile(np.arange(n), (len(seqs), 1)).astype(np.int64)
        got = dict(zip(names, session.run(None, feeds)))
        want = run_torch(model, {**step_feeds(config, rows, lengths, want_caches),
                                 "logits_index": feeds["logits_index"]}, ["logits_index"])
        np.testing.assert_allclose(got["logits"], want[0], atol=1e-4, rtol=1e-4)
        lengths = [m + n for m in lengths]
        caches, want_caches = [got[k] for k in names[3:]], want[3:]


def test_target_graph_prefill_decode_verify(trt_engine, torch_target):
    """Two rows of different lengths: prefill (5 and 3 tokens), one decode step each, then a
    3-token verification after the past; logits and hidden states equal torch's, and the
    caches the graph hands back equal torch's on every row below each stream's length."""
    model, config = torch_target
    proto, session = graph(trt_engine, "target")
    ops = {n.op_type for n in proto.graph.node}
    assert {"TRT_Attention", "TRT_KVCacheUpdate"} <= ops and "GroupQueryAttention" not in ops
    caches = [c.numpy() for c in empty_cache(config, 2, MAX_LEN)]
    want_caches = [c.copy() for c in caches]
    lengths = [0, 0]
    steps = [([[5, 17, 99, 3, 42], [8, 77, 61]], "prefill"),
             ([[23], [11]], "decode"),
             ([[90, 4, 56], [31, 7, 9]], "verify")]
    for rows, what in steps:
        feeds = step_feeds(config, rows, lengths, caches)
        last = np.array([[len(r) - 1] for r in rows]) if what == "prefill" else \
            np.tile(np.arange(len(rows[0])), (2, 1))
        feeds["logits_index"] = last.astype(np.int64)
        names = [o.name for o in proto.graph.output]
        got = dict(zip(names, session.run(None, feeds)))
        # torch runs on its own caches (the reference writes only valid rows)
        want = run_torch(model, {**step_feeds(config, rows, lengths, want_caches),
                                 "logits_index": feeds["logits_index"]}, ["logits_index"])
        np.testing.assert_allclose(got["logits"], want[0], atol=1e-4, err_msg=what)
        for b, row in enumerate(rows):
            np.testing.assert_allclose(got["hidden_states"][b, :len(row)], want[1][b, :len(row)],
                                       atol=1e-4, err_msg=what)
        lengths = [n + len(r) for n, r in zip(lengths, rows)]
        caches = [got[n] for n in names[3:]]
        want_caches = want[3:]
        for c, w in zip(caches, want_caches):
            for b, n in enumerate(lengths):
                np.testing.assert_allclose(c[b, :, :n], w[b, :, :n], atol=1e-5, err_msg=what)


def test_score_graph_returns_tokens(trt_engine, torch_target):
    """After a prefill, a verification step through the score graph (TRT attention + the
    SpecVerify node): accepted counts and tokens equal the torch scorer's and the NumPy
    reference on the target's logits; rows greedy and stochastic, with 2 and 3 drafts."""
    model, config = torch_target
    _, target = graph(trt_engine, "target")
    proto, score = graph(trt_engine, "score")
    assert "SpecVerify" in {n.op_type for n in proto.graph.node}
    caches = [c.numpy() for c in empty_cache(config, 2, MAX_LEN)]
    feeds = step_feeds(config, [[5, 17, 99, 3], [8, 77, 61]], [0, 0], caches)
    feeds["logits_index"] = np.array([[3], [2]], np.int64)
    out = target.run(None, feeds)
    caches = out[3:]
    last = [int(out[0][b, 0].argmax()) for b in range(2)]
    rows = [[last[0], 12, 40, 7], [last[1], 3, 0]]
    # row 0's first draft := the target's greedy token after `last` (causal: logits at
    # position 0 do not depend on the drafts), so at least one draft is accepted there
    probe = step_feeds(config, rows, [4, 3], caches)
    probe["logits_index"] = np.zeros((2, 1), np.int64)
    rows[0][1] = int(target.run(None, probe)[0][0, 0].argmax())
    feeds = step_feeds(config, rows, [4, 3], caches)
    t = feeds["input_ids"].shape[1]
    verify = {"seed": np.array([3, -5], np.int64), "position": np.array([1, 1], np.int64),
              "temperature": np.array([0.0, 0.8], np.float32),
              "top_k": np.zeros(2, np.int32), "top_p": np.ones(2, np.float32)}
    feeds.update(verify)
    got = score.run(None, feeds)
    want = run_torch(TargetScorer(model).eval(), feeds,
                     ["seed", "position", "temperature", "top_k", "top_p"])
    np.testing.assert_array_equal(got[0], want[0])
    np.testing.assert_array_equal(got[1], want[1])
    # and the NumPy reference, on the target graph's logits for the same step
    tfeeds = {k: v for k, v in feeds.items() if k not in verify}
    tfeeds["logits_index"] = np.tile(np.arange(t), (2, 1)).astype(np.int64)
    target_logits = target.run(None, tfeeds)[0]
    lens = feeds["query_seqlens"] - 1
    accepted, tokens = spec_verify_reference(feeds["input_ids"][:, 1:], lens, target_logits,
                                             verify["seed"], verify["position"],
                                             verify["temperature"], verify["top_k"],
                                             verify["top_p"])
    np.testing.assert_array_equal(got[0], accepted)
    np.testing.assert_array_equal(got[1], tokens)
    assert accepted[0] >= 1  # the first draft was the target's greedy token


def test_fp16_trt_target_graph_is_valid(torch_target):
    """--precision fp16 for trt: the graph's float tensors are float16 (TensorRT builds
    strongly typed from them) and the graph passes the checker."""
    from trt_spec.export.onnx_export import export_target
    from trt_spec.plugins.lowering import lowering

    model, _ = torch_target
    with lowering("trt"):
        proto = export_target(copy.deepcopy(model).half())
    onnx.checker.check_model(proto)
    types = {i.name: i.type.tensor_type.elem_type for i in proto.graph.input}
    assert types["past_key_values.0.key"] == onnx.TensorProto.FLOAT16
    assert {o.name: o.type.tensor_type.elem_type for o in proto.graph.output}["logits"] == \
        onnx.TensorProto.FLOAT16


def test_mtp_drafter_trt_graph_equals_torch(torch_target):
    """A drafter step graph (one MTP module) lowered for TensorRT: checker, then one 3-token
    step after a 2-token past through onnx.reference equals the torch module."""
    from tests.random_drafters import random_mtp
    from trt_spec.export.onnx_export import export_drafter
    from trt_spec.plugins.lowering import lowering

    model, config = torch_target
    module = random_mtp(model, 1, seed=3).modules[0].eval()
    with lowering("trt"):
        proto = export_drafter(module, config.vocab_size)
    onnx.checker.check_model(proto)
    session = ReferenceEvaluator(proto, new_ops=REFERENCE_OPS)
    rng = np.random.default_rng(0)
    caches = [rng.normal(size=c.shape).astype(np.float32)
              for c in empty_cache(config, 1, MAX_LEN)[:2]]
    feeds = step_feeds(config, [[4, 9, 33]], [2], caches)
    feeds["hidden_states"] = rng.normal(size=(1, 3, config.hidden_size)).astype(np.float32)
    feeds["logits_index"] = np.arange(3)[None].astype(np.int64)
    got = session.run(None, feeds)
    names = ["input_ids", "hidden_states", "position_ids", "seqlens_k", "query_seqlens",
             "total_sequence_length", "logits_index"]
    with torch.no_grad():
        want = module(*[torch.from_numpy(np.asarray(feeds[n])) for n in names],
                      *[torch.from_numpy(c) for c in caches])
    np.testing.assert_allclose(got[0], want[0].numpy(), atol=1e-4)  # logits
    np.testing.assert_allclose(got[1], want[1].numpy(), atol=1e-4)  # next hidden states


def test_build_plan_of_a_trt_export_registers_its_plugins(trt_engine):
    """What export records ("plugins": the plugin ops of the graph) is what `trt-spec build`
    turns into the module to import before parsing: the two halves of the TRT path agree."""
    from trt_spec.export.trt_build import build_plan
    from trt_spec.runtime.manifest import load_manifest

    plans = {p.name: p for p in build_plan(load_manifest(trt_engine), max_batch=2,
                                           max_draft_tokens=3, max_len=64)}
    assert plans["score"].plugins == {"libraries": [],
                                      "python_modules": ["trt_spec.plugins.trt_register"]}
    assert plans["target"].plugins == {"libraries": [], "python_modules": []}
    assert {p.source_backend for p in plans.values()} == {"trt"}
