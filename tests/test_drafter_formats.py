"""Drafter checkpoints in every layout: loaded modules against a plain re-implementation of the
published forward (written here from the formulas, on the checkpoint's own keys), then the
exported ORT graphs against the torch modules; first step and later steps."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from tests.random_drafters import eagle3_tensors, mtp_tensors, write_checkpoint  # noqa: E402
from trt_spec.export.checkpoint import load_target  # noqa: E402
from trt_spec.export.drafter_checkpoint import load_drafter, save_drafter  # noqa: E402
from trt_spec.export.model import empty_cache  # noqa: E402
from trt_spec.export.onnx_export import export_drafter, export_fc  # noqa: E402
from trt_spec.runtime.backends.ort import OrtFunction, OrtTarget  # noqa: E402
from trt_spec.runtime.kv_cache import KVCache  # noqa: E402
from trt_spec.runtime.step_inputs import SlotTokens  # noqa: E402

EPS = 1e-5


# --- the published forwards, from the formulas ---------------------------------------------

def rms(x, w):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * w


def rope(x, theta):
    """x: (heads, T, hd) at positions 0..T-1; rotate_half convention."""
    hd = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd)
    ang = torch.outer(torch.arange(x.shape[1], dtype=torch.float64), inv)
    cos = torch.cat([ang.cos(), ang.cos()], -1).float()
    sin = torch.cat([ang.sin(), ang.sin()], -1).float()
    rotated = torch.cat([-x[..., hd // 2:], x[..., :hd // 2]], -1)
    return x * cos + rotated * sin


def llama_layer_tail(W, p, attn_in, residual, heads, kv_heads, theta):
    """Causal attention over all rows from attn_in, residual add, then the MLP block."""
    T = attn_in.shape[0]
    q = (attn_in @ W[p + "self_attn.q_proj.weight"].T).view(T, heads, -1).transpose(0, 1)
    k = (attn_in @ W[p + "self_attn.k_proj.weight"].T).view(T, kv_heads, -1).transpose(0, 1)
    v = (attn_in @ W[p + "self_attn.v_proj.weight"].T).view(T, kv_heads, -1).transpose(0, 1)
    q, k = rope(q, theta), rope(k, theta)
    k = k.repeat_interleave(heads // kv_heads, 0)
    v = v.repeat_interleave(heads // kv_heads, 0)
    scores = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
    scores = scores.masked_fill(torch.ones(T, T).triu(1).bool(), float("-inf"))
    a = (scores.softmax(-1) @ v).transpose(0, 1).reshape(T, -1)
    h = residual + a @ W[p + "self_attn.o_proj.weight"].T
    x = rms(h, W[p + "post_attention_layernorm.weight"])
    mlp = (torch.nn.functional.silu(x @ W[p + "mlp.gate_proj.weight"].T)
           * (x @ W[p + "mlp.up_proj.weight"].T)) @ W[p + "mlp.down_proj.weight"].T
    return h + mlp


def ref_mtp(W, p, cfg, embed, head_norm, head, tokens, hidden):
    """DeepSeek-V3 MTP module i (prefix p): tokens [T], hidden [T, H] -> logits, h."""
    e = rms(embed[tokens], W[p + "enorm.weight"])
    h = torch.cat([e, rms(hidden, W[p + "hnorm.weight"])], -1) @ W[p + "eh_proj.weight"].T
    x = rms(h, W[p + "input_layernorm.weight"])
    h = llama_layer_tail(W, p, x, h, cfg["num_attention_heads"], cfg["num_key_value_heads"],
                         cfg["rope_theta"])
    return rms(h, head_norm) @ head.T, h


def ref_eagle3(W, layer, norm, cfg, embed, tokens, g):
    """EAGLE-3 midlayer + norm + lm_head: tokens [T], g [T, H] -> draft logits, h."""
    e = rms(embed[tokens], W[layer + "input_layernorm.weight"])
    x = torch.cat([e, rms(g, W[layer + "hidden_norm.weight"])], -1)
    h = llama_layer_tail(W, layer, x, g, cfg["num_attention_heads"], cfg["num_key_value_heads"],
                         cfg["rope_theta"])
    return rms(h, W[norm]) @ W["lm_head.weight"].T, h


# --- our modules, run step by step over their cache -----------------------------------------

def run_torch(module, steps):
    """steps: [(tokens [T], hidden [T, H])] fed one after the other over one cache ->
    [(logits [T, V], next_hidden [T, H])]."""
    past = empty_cache(module.config, 1, 32)
    n, out = 0, []
    for tokens, hidden in steps:
        t = len(tokens)
        with torch.no_grad():
            logits, h, k, v = module(
                torch.tensor([tokens]), hidden[None], torch.arange(n, n + t)[None],
                torch.tensor([n + t - 1], dtype=torch.int32), torch.tensor([t], dtype=torch.int32),
                torch.tensor(n + t, dtype=torch.int32), torch.arange(t)[None], *past)
        past, n = [k, v], n + t
        out.append((logits[0], h[0]))
    return out


def run_ort(module, head_vocab, folder, steps):
    path = folder / "drafter.onnx"
    export_drafter(module, head_vocab, path)
    graph = OrtTarget(path, 1, module.config.max_position_embeddings)
    cache = KVCache(module.config, slots=2, max_len=32)
    slot = cache.allocate()
    out = []
    for tokens, hidden in steps:
        r = graph.step(cache, [SlotTokens(slot, tokens, list(range(len(tokens))),
                                       hidden.numpy())], ("next_hidden_states",))
        out.append((r.logits[0], r.rows["next_hidden_states"][0]))
    return out


@pytest.fixture(scope="module")
def target(tiny_hf_dir):
    model, _ = load_target(tiny_hf_dir)
    return model


TOKENS = [5, 17, 99, 3, 42, 8]


@pytest.mark.parametrize("layout,binary", [("midlayer", False), ("model", False),
                                           ("midlayer", True)])
def test_eagle3_published_layouts(target, tmp_path, layout, binary):
    W, cfg = eagle3_tensors(target.config, seed=3, layout=layout)
    drafter = load_drafter(write_checkpoint(tmp_path / "ckpt", W, cfg, binary), "eagle3", target)
    layer, fc, norm = (("midlayer.", "fc.", "norm.weight") if layout == "midlayer"
                       else ("model.layers.0.", "model.fc.", "model.norm.weight"))
    embed = target.embed_tokens.weight.detach()  # absent from the checkpoint: the target's
    features = torch.randn(len(TOKENS), 3 * target.config.hidden_size)
    g = features @ W[fc + "weight"].T
    ref_logits, ref_h = ref_eagle3(W, layer, norm, cfg, embed, TOKENS, g)
    with torch.no_grad():
        torch.testing.assert_close(drafter.fc(features), g, atol=1e-5, rtol=1e-5)
    # later step: the head's own last hidden state and a drafted token
    g2 = torch.cat([g, ref_h[-1:]])
    ref2_logits, _ = ref_eagle3(W, layer, norm, cfg, embed, TOKENS + [61], g2)
    steps = [(TOKENS, g), ([61], ref_h[-1:])]
    step = drafter.modules[0]
    (l1, h1), (l2, _) = run_torch(step, steps)
    torch.testing.assert_close(l1, ref_logits, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(h1, ref_h, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(l2, ref2_logits[-1:], atol=1e-4, rtol=1e-4)
    # ids: target = draft + d2t
    assert drafter.d2t.tolist() == W["d2t"].tolist()
    # ORT against torch, and the fc graph
    (o1, oh1), (o2, _) = run_ort(step, len(W["d2t"]), tmp_path, steps)
    np.testing.assert_allclose(o1, l1.numpy(), atol=1e-4)
    np.testing.assert_allclose(oh1, h1.numpy(), atol=1e-4)
    np.testing.assert_allclose(o2, l2.numpy(), atol=1e-4)
    export_fc(drafter.fc, tmp_path / "fc.onnx")
    np.testing.assert_allclose(OrtFunction(tmp_path / "fc.onnx")(features[None].numpy())[0],
                               g.numpy(), atol=1e-5)


@pytest.mark.parametrize("shared_head", [True, False])
def test_deepseek_mtp_layout(target, tmp_path, shared_head):
    t = target.config
    W, cfg = mtp_tensors(t, seed=4, n=2, shared_head=shared_head)
    # The target's own keys beside the MTP layers, as in a full DeepSeek-V3 checkpoint.
    W_full = {**W, "model.norm.weight": target.norm.detach().clone()}
    drafter = load_drafter(write_checkpoint(tmp_path / "ckpt", W_full, cfg), "mtp", target)
    assert drafter.kind == "mtp" and len(drafter.modules) == 2
    embed = target.embed_tokens.weight.detach()
    hidden = torch.randn(len(TOKENS), t.hidden_size)
    for i, module in enumerate(drafter.modules):
        p = f"model.layers.{t.num_layers + i}."
        head_norm = W[p + "shared_head.norm.weight"] if shared_head else target.norm.detach()
        head = W[p + "shared_head.head.weight"] if shared_head else embed  # tied target head
        ref_logits, ref_h = ref_mtp(W, p, cfg, embed, head_norm, head, TOKENS, hidden)
        hidden2 = torch.cat([hidden, ref_h[-1:]])
        ref2_logits, _ = ref_mtp(W, p, cfg, embed, head_norm, head, TOKENS + [61], hidden2)
        steps = [(TOKENS, hidden), ([61], ref_h[-1:])]
        (l1, h1), (l2, _) = run_torch(module, steps)
        torch.testing.assert_close(l1, ref_logits, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(h1, ref_h, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(l2, ref2_logits[-1:], atol=1e-4, rtol=1e-4)
        (o1, oh1), (o2, _) = run_ort(module, t.vocab_size, tmp_path / f"m{i}", steps)
        np.testing.assert_allclose(o1, l1.numpy(), atol=1e-4)
        np.testing.assert_allclose(oh1, h1.numpy(), atol=1e-4)
        np.testing.assert_allclose(o2, l2.numpy(), atol=1e-4)
    # Eagle from the same checkpoint: module 0, the others skipped
    eagle = load_drafter(tmp_path / "ckpt", "eagle", target)
    assert len(eagle.modules) == 1
    torch.testing.assert_close(eagle.modules[0].eh_proj.weight, drafter.modules[0].eh_proj.weight)


@pytest.mark.parametrize("kind", ["mtp", "eagle3"])
def test_own_format_round_trip(target, tmp_path, kind):
    if kind == "mtp":
        W, cfg = mtp_tensors(target.config, seed=5, n=3)
    else:
        W, cfg = eagle3_tensors(target.config, seed=5)
    drafter = load_drafter(write_checkpoint(tmp_path / "ckpt", W, cfg), kind, target)
    save_drafter(drafter, tmp_path / "own")
    again = load_drafter(tmp_path / "own", kind, target)
    assert again.kind == kind and len(again.modules) == len(drafter.modules)
    assert again.feature_layers == drafter.feature_layers
    for a, b in zip(drafter.modules, again.modules):
        for (ka, va), (kb, vb) in zip(a.state_dict().items(), b.state_dict().items()):
            assert ka == kb
            torch.testing.assert_close(vb, va.half().float() if "embed" not in ka else va)  # fp16
    if kind == "eagle3":
        torch.testing.assert_close(again.fc.fc.weight, drafter.fc.fc.weight.half().float())
        assert torch.equal(again.d2t, drafter.d2t)


# --- strictness: each failure names the key -------------------------------------------------

def eagle3_dir(tmp_path, target, edit):
    W, cfg = eagle3_tensors(target.config, seed=6)
    edit(W, cfg)
    return write_checkpoint(tmp_path / "bad", W, cfg)


@pytest.mark.parametrize("edit,error,words", [
    (lambda W, c: W.pop("midlayer.self_attn.k_proj.weight"), KeyError,
     ["missing", "midlayer.self_attn.k_proj.weight"]),
    (lambda W, c: W.__setitem__("midlayer.extra.weight", torch.zeros(3)), KeyError,
     ["unexpected", "midlayer.extra.weight"]),
    (lambda W, c: W.__setitem__("fc.weight", torch.zeros(64, 64)), ValueError,
     ["fc.weight", "(64, 64)", "(64, 192)"]),
    (lambda W, c: c.__setitem__("vocab_size", 200), ValueError, ["vocab_size 200", "128"]),
    (lambda W, c: W.__setitem__("d2t", W["d2t"] + 500), ValueError, ["d2t"]),
    (lambda W, c: W.pop("midlayer.input_layernorm.weight"), KeyError, ["not an EAGLE3"]),
])
def test_eagle3_loader_errors(target, tmp_path, edit, error, words):
    with pytest.raises(error) as e:
        load_drafter(eagle3_dir(tmp_path, target, edit), "eagle3", target)
    for word in words:
        assert word in str(e.value)


def mtp_dir(tmp_path, target, edit):
    W, cfg = mtp_tensors(target.config, seed=7, n=1)
    edit(W, cfg)
    return write_checkpoint(tmp_path / "bad", W, cfg)


@pytest.mark.parametrize("edit,error,words", [
    (lambda W, c: W.pop("model.layers.4.eh_proj.weight"), KeyError,
     ["missing", "model.layers.4.eh_proj.weight"]),
    (lambda W, c: W.__setitem__("model.layers.5.enorm.weight", torch.ones(64)), KeyError,
     ["unexpected", "model.layers.5.enorm.weight"]),
    (lambda W, c: W.__setitem__("model.layers.4.hnorm.weight", torch.ones(32)), ValueError,
     ["model.layers.4.hnorm.weight", "(32,)", "(64,)"]),
    (lambda W, c: W.__setitem__("model.layers.4.shared_head.head.weight", torch.zeros(100, 64)),
     ValueError, ["lm_head.weight", "100 rows", "128"]),
    (lambda W, c: c.__setitem__("kv_lora_rank", 512), ValueError, ["MLA"]),
    (lambda W, c: W.__setitem__("model.layers.4.mlp.experts.0.up_proj.weight", torch.ones(1)),
     ValueError, ["mixture of experts"]),
    (lambda W, c: c.__setitem__("num_hidden_layers", 6), ValueError, ["num_hidden_layers 6"]),
])
def test_mtp_loader_errors(target, tmp_path, edit, error, words):
    with pytest.raises(error) as e:
        load_drafter(mtp_dir(tmp_path, target, edit), "mtp", target)
    for word in words:
        assert word in str(e.value)


def test_own_format_errors(target, tmp_path):
    W, cfg = mtp_tensors(target.config, seed=8, n=1)
    drafter = load_drafter(write_checkpoint(tmp_path / "ckpt", W, cfg), "mtp", target)
    save_drafter(drafter, tmp_path / "own")
    with pytest.raises(ValueError, match="holds a 'mtp' drafter, not 'eagle3'"):
        load_drafter(tmp_path / "own", "eagle3", target)
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(tmp_path / "own" / "model.safetensors"))
    tensors.pop("modules.0.enorm")
    save_file(tensors, str(tmp_path / "own" / "model.safetensors"))
    with pytest.raises(KeyError, match="enorm"):
        load_drafter(tmp_path / "own", "mtp", target)
    with pytest.raises(FileNotFoundError, match="is not a folder"):
        load_drafter(tmp_path / "nowhere", "mtp", target)


def test_untied_embedding_to_int8(target, tmp_path):
    """A drafter's own embedding table becomes one int8 GatherBlockQuantized, which computes
    exactly what the fp32 graph does with the table rounded to int8 blocks."""
    import onnx

    from trt_spec.export.onnx_export import save_with_external_data
    from trt_spec.export.quantize import dequantize_int8, embedding_int8, quantize_int8

    W, cfg = eagle3_tensors(target.config, seed=9)
    step = load_drafter(write_checkpoint(tmp_path / "ckpt", W, cfg), "eagle3", target).modules[0]
    steps = [(TOKENS, torch.randn(len(TOKENS), target.config.hidden_size))]
    export_drafter(step, len(W["d2t"]), tmp_path / "q.onnx")
    proto = onnx.load(str(tmp_path / "q.onnx"))
    assert embedding_int8(proto, min_rows=64) == 1
    ops = [n.op_type for n in proto.graph.node]
    assert ops.count("GatherBlockQuantized") == 1 and "Gather" not in ops
    save_with_external_data(proto, tmp_path / "q.onnx")
    graph = OrtTarget(tmp_path / "q.onnx", 1, step.config.max_position_embeddings)
    cache = KVCache(step.config, slots=1, max_len=32)
    got = graph.step(cache, [SlotTokens(cache.allocate(), TOKENS, list(range(len(TOKENS))),
                                     steps[0][1].numpy())]).logits[0]
    e = step.embed_tokens.weight.detach().numpy()
    with torch.no_grad():
        step.embed_tokens.weight.copy_(torch.from_numpy(
            dequantize_int8(*quantize_int8(e.T), *e.T.shape).T.copy()))
    (want, _), = run_torch(step, steps)
    np.testing.assert_allclose(got, want.numpy(), atol=1e-4)
