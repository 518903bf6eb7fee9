"""Our vanilla draft as a GGUF for llama.cpp (export/gguf_draft.py), and the llama.cpp peers
that speculate with it or with n-gram lookup. The real server only where it is installed."""

from __future__ import annotations

import json

import numpy as np
import pytest

from trt_spec.export.gguf_draft import draft_to_gguf, from_gguf_rows, to_gguf_rows
from trt_spec.tools.peers import PeerContext

gguf = pytest.importorskip("gguf")
torch = pytest.importorskip("torch")


def test_rows_are_reordered_as_rope_pairs():
    """One head of dim 4: Hugging Face's halves (x0 x1 | y0 y1) -> llama.cpp's pairs
    (x0 y0 x1 y1); two heads independently; the inverse restores them."""
    w = np.arange(8, dtype=np.float32)[:, None] * np.ones((1, 3), np.float32)
    assert to_gguf_rows(w, 2)[:, 0].tolist() == [0, 2, 1, 3, 4, 6, 5, 7]
    x = np.random.default_rng(0).standard_normal((3 * 8, 5)).astype(np.float32)
    assert np.array_equal(from_gguf_rows(to_gguf_rows(x, 3), 3), x)


@pytest.fixture(scope="module")
def tiny_target_gguf(tiny_hf_dir, tmp_path_factory):
    """A GGUF holding what the draft takes from its target: the tiny model's metadata, a
    tokenizer field and its token embedding (F32)."""
    from trt_spec.export.checkpoint import load_target

    target, c = load_target(tiny_hf_dir)
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    w = gguf.GGUFWriter(path, "llama")
    w.add_name("tiny")
    w.add_block_count(c.num_layers)
    w.add_embedding_length(c.hidden_size)
    w.add_head_count(c.num_heads)
    w.add_head_count_kv(c.num_kv_heads)
    w.add_token_list([f"t{i}" for i in range(c.vocab_size)])
    w.add_tensor("token_embd.weight", target.embed_tokens.weight.detach().numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_draft_gguf_holds_the_draft(tiny_target_gguf, tiny_draft, tmp_path):
    from safetensors.numpy import load_file

    out = draft_to_gguf(tiny_target_gguf, tiny_draft, tmp_path / "d.gguf")
    r = gguf.GGUFReader(out)
    field = lambda k: r.fields[k].contents()  # noqa: E731
    assert field("general.architecture") == "llama" and field("llama.block_count") == 2
    assert field("general.name").startswith("tiny draft")
    target = gguf.GGUFReader(tiny_target_gguf)
    assert field("tokenizer.ggml.tokens") == target.fields["tokenizer.ggml.tokens"].contents()
    tensors = {t.name: t for t in r.tensors}
    assert np.array_equal(tensors["token_embd.weight"].data,
                          next(t for t in target.tensors if t.name == "token_embd.weight").data)
    assert "output.weight" not in tensors  # tied: llama.cpp takes the embedding

    meta = json.loads((tiny_draft / "drafter.json").read_text())["model_config"]
    state = load_file(tiny_draft / "model.safetensors")
    q = meta["num_heads"] * meta["head_dim"]
    kv = meta["num_kv_heads"] * meta["head_dim"]
    for i in range(2):
        qkv = state[f"layers.{i}.qkv_proj.weight"]
        got = lambda n: np.asarray(tensors[f"blk.{i}.{n}"].data)  # noqa: E731
        assert got("attn_q.weight").dtype == np.float16
        assert np.array_equal(from_gguf_rows(got("attn_q.weight"), meta["num_heads"]), qkv[:q])
        assert np.array_equal(from_gguf_rows(got("attn_k.weight"), meta["num_kv_heads"]),
                              qkv[q:q + kv])
        assert np.array_equal(got("attn_v.weight"), qkv[q + kv:])
        gate_up = state[f"layers.{i}.gate_up_proj.weight"]
        ffn = meta["intermediate_size"]
        assert np.array_equal(got("ffn_gate.weight"), gate_up[:ffn])
        assert np.array_equal(got("ffn_up.weight"), gate_up[ffn:])
        assert np.array_equal(got("ffn_down.weight"), state[f"layers.{i}.down_proj.weight"])
        assert np.array_equal(got("attn_norm.weight"),
                              state[f"layers.{i}.input_layernorm"].astype(np.float32))
    assert np.array_equal(np.asarray(tensors["output_norm.weight"].data),
                          state["norm"].astype(np.float32))

    # written once: the same target and draft find it, a changed draft rewrites it
    stamp = out.stat().st_mtime_ns
    assert draft_to_gguf(tiny_target_gguf, tiny_draft, out).stat().st_mtime_ns == stamp
    assert not (tmp_path / "d.gguf.tmp").exists()


def test_draft_gguf_refuses_what_it_cannot_write(tiny_target_gguf, tiny_draft, tmp_path):
    other = tmp_path / "mtp"
    other.mkdir()
    (other / "model.safetensors").write_bytes(b"x")
    (other / "drafter.json").write_text(json.dumps({"kind": "mtp", "model_config": {}}))
    with pytest.raises(ValueError, match="holds a 'mtp' drafter, not a vanilla draft"):
        draft_to_gguf(tiny_target_gguf, other, tmp_path / "d.gguf")


@pytest.mark.slow
def test_draft_of_the_targets_layers_is_the_targets_gguf_layers(smollm2_hf_dir, tmp_path):
    """A draft made of SmolLM2's layers 0 and 1, untrained, written as a GGUF: its tensors
    are the target GGUF's own blk.0 / blk.1 (dequantized), to fp16 rounding. This checks
    the q/k row order against llama.cpp's layout as the GGUF itself stores it."""
    from trt_spec.export.checkpoint import load_target
    from trt_spec.export.drafter_checkpoint import save_draft
    from trt_spec.tools.peers.llamacpp import gguf_file
    from trt_spec.train.draft import init_draft

    target_gguf = gguf_file("smollm2-135m")
    target, _ = load_target(smollm2_hf_dir)
    folder = tmp_path / "draft"
    save_draft(init_draft(target, (0, 1)), folder, (0, 1))
    ours = {t.name: t for t in gguf.GGUFReader(draft_to_gguf(target_gguf, folder,
                                                              tmp_path / "d.gguf")).tensors}
    checked = 0
    for t in gguf.GGUFReader(target_gguf).tensors:
        if t.name.startswith(("blk.0.", "blk.1.")):
            want = gguf.quants.dequantize(t.data, t.tensor_type)
            got = np.asarray(ours[t.name].data, np.float32).reshape(want.shape)
            assert np.abs(got - want).max() <= 2e-3 * max(1.0, np.abs(want).max()), t.name
            checked += 1
    assert checked == 18


def fake_ctx(tmp_path, model, draft, k=3) -> PeerContext:
    return PeerContext(model=str(model), draft=str(draft) if draft else None, threads=2,
                       num_draft_tokens=k, cache=tmp_path / "cache")


def test_llamacpp_speculating_peers_arguments(tiny_target_gguf, tiny_draft, tmp_path):
    """What each speculating llama.cpp peer starts its server with (no server needed)."""
    from trt_spec.tools.peers.llamacpp import LlamaCppDraftPeer, LlamaCppNgramPeer, LlamaCppPeer

    peer = LlamaCppDraftPeer()
    args, speculating = peer.server_args(fake_ctx(tmp_path, tiny_target_gguf, tiny_draft, 2),
                                         tiny_target_gguf)
    draft = tmp_path / "cache" / "draft.gguf"
    assert args == ["--spec-type", "draft-simple", "-md", str(draft), "--spec-draft-n-max", "2",
                    "-td", "2", "-tbd", "2"]
    assert speculating and draft.is_file() and peer.num_draft_tokens == 2
    with pytest.raises(ValueError, match="no vanilla draft"):
        LlamaCppDraftPeer().server_args(fake_ctx(tmp_path, tiny_target_gguf, None),
                                        tiny_target_gguf)
    peer = LlamaCppNgramPeer()
    args, speculating = peer.server_args(fake_ctx(tmp_path, tiny_target_gguf, None, 4),
                                         tiny_target_gguf)
    assert args == ["--spec-type", "ngram-simple", "--spec-draft-n-max", "4"] and speculating
    assert LlamaCppPeer().server_args(None, tiny_target_gguf) == ([], False)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["llama.cpp-draft", "llama.cpp-ngram"])
def test_llamacpp_speculating_peers_on_smollm2(name, tmp_path):
    """The real GGUF through llama-server, speculating: N tokens, its acceptance (the draft
    peer), whether its output equals its own plain output, both servers gone after."""
    from trt_spec.tools.peers import PEERS
    from trt_spec.tools.peers.llamacpp import gguf_file

    peer = PEERS[name]()
    ok, reason = peer.available()
    if not ok:
        pytest.skip(reason)
    if not gguf_file("smollm2-135m").is_file():
        pytest.skip("the SmolLM2 GGUF is not cached")
    from trt_spec.export.checkpoint import shipped_drafters

    draft = shipped_drafters("smollm2-135m").get("draft")
    peer.load(PeerContext(model="smollm2-135m", draft=draft, threads=2, num_draft_tokens=2,
                          cache=tmp_path))
    prompt = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 2]
    try:
        r = peer.generate(prompt, 16, 0.0, 0)
        assert r["completion_tokens"] == 16 == len(r["output_ids"])
        assert isinstance(r["same_as_own_plain"], bool)
        if name == "llama.cpp-draft":
            assert 0 <= r["acceptance_rate"] <= 1
        servers = [peer.server.proc, peer.plain_server.proc]
    finally:
        peer.close()
    assert all(p.poll() is not None for p in servers)
