"""Smoothing a target for 8-bit activations (the int8-rows precision), SmoothQuant-style.

Quantizing each row of a MatMul's input to int8 by its largest magnitude loses the small
channels wherever a few channels are large (LLMs have such outlier channels, in fixed
places). Every MatMul input here is made by something whose per-channel scale can move into
the weights that read it, exactly in real arithmetic:

    qkv, gate/up   x = rms_norm(h) * g           g /= s,  W[j, :] *= s_j   (the norm's weight)
    o              a = softmax(..) v, per head   v's columns /= s,  W_o[j, :] *= s_j
                                                 (s per kv channel: q heads sharing a kv head
                                                 share its scale)
    down           m = act(gate) * up            up's columns /= s,  W_down[j, :] *= s_j

with s_j = max|x_j|^alpha / max|W_j|^(1 - alpha) from calibration text, which evens out the
channels the 8-bit rows see against the channels the 8-bit weight columns see. The model's
fp32 outputs are unchanged up to rounding (tests/test_int8_rows.py checks it).
"""

from __future__ import annotations

import torch

from trt_spec.export.model import TargetModel, empty_cache

ALPHA = 0.5  # SmoothQuant's migration strength: how much of the activations' range moves


@torch.inference_mode()
def input_maxima(target: TargetModel, sequences: list[list[int]]) -> dict[str, torch.Tensor]:
    """Per nn.Linear of the target's layers (by module name): max |input| per input channel
    over the sequences, each run as one prefill from an empty cache."""
    maxima: dict[str, torch.Tensor] = {}
    hooks = []
    for name, module in target.layers.named_modules():
        if isinstance(module, torch.nn.Linear):
            def record(mod, args, out, name=name):
                m = args[0].detach().abs().flatten(0, -2).amax(0).float()
                maxima[name] = m if name not in maxima else torch.maximum(maxima[name], m)
            hooks.append(module.register_forward_hook(record))
    try:
        for seq in sequences:
            n = len(seq)
            ids = torch.tensor(seq, dtype=torch.int64)[None]
            positions = torch.arange(n)[None]
            target(ids, positions, torch.tensor([n - 1], dtype=torch.int32),
                   torch.tensor([n], dtype=torch.int32), torch.tensor(n, dtype=torch.int32),
                   positions[:, -1:], *empty_cache(target.config, 1, n))
    finally:
        for h in hooks:
            h.remove()
    return maxima


def factors(x_max: torch.Tensor, w: torch.Tensor, alpha: float) -> torch.Tensor:
    """s_j = max|x_j|^alpha / max|W_j|^(1-alpha) for W [out, in] (nn.Linear's layout), 1
    where a channel was never seen or its weights are 0."""
    w_max = w.detach().abs().amax(0).float()
    s = x_max.clamp(min=1e-5).pow(alpha) / w_max.clamp(min=1e-5).pow(1 - alpha)
    ok = (x_max > 0) & (w_max > 0) & torch.isfinite(s)
    return torch.where(ok, s, torch.ones_like(s))


@torch.no_grad()
def smooth(target: TargetModel, maxima: dict[str, torch.Tensor], alpha: float = ALPHA) -> int:
    """Moves each MatMul input's channel scales into its weights, in place (the module
    docstring). Returns how many inputs were smoothed."""
    c = target.config
    hd, nh, kvh = c.head_dim, c.num_heads, c.num_kv_heads
    norms = [layer.input_layernorm for layer in target.layers]
    done = 0
    for i, layer in enumerate(target.layers):
        p = f"{i}."
        # qkv reads rms_norm(h) * input_layernorm; gate/up reads the post-attention norm
        for linear, norm in ((layer.qkv_proj, norms[i]),
                             (layer.gate_up_proj, layer.post_attention_layernorm)):
            name = p + ("qkv_proj" if linear is layer.qkv_proj else "gate_up_proj")
            if name in maxima:
                s = factors(maxima[name], linear.weight, alpha)
                norm.div_(s.to(norm.dtype))
                linear.weight.mul_(s.to(linear.weight.dtype))
                done += 1
        # o reads attention outputs: channel h*hd + d is a mix of v's kv channel (h // g)*hd + d
        if p + "o_proj" in maxima:
            g = nh // kvh
            per_q = factors(maxima[p + "o_proj"], layer.o_proj.weight, alpha).view(nh, hd)
            per_kv = per_q.view(kvh, g, hd).amax(1)  # one scale per kv channel
            s = per_kv.repeat_interleave(g, 0).reshape(-1)  # back to the o input's channels
            v = slice((nh + kvh) * hd, (nh + 2 * kvh) * hd)
            layer.qkv_proj.weight[v].div_(per_kv.reshape(-1, 1).to(layer.qkv_proj.weight.dtype))
            if layer.qkv_proj.bias is not None:
                layer.qkv_proj.bias[v].div_(per_kv.reshape(-1).to(layer.qkv_proj.bias.dtype))
            layer.o_proj.weight.mul_(s.to(layer.o_proj.weight.dtype))
            done += 1
        # down reads act(gate) * up: up's output channels carry the scale
        if p + "down_proj" in maxima:
            s = factors(maxima[p + "down_proj"], layer.down_proj.weight, alpha)
            inter = c.intermediate_size
            up = layer.gate_up_proj.weight[inter:]
            up.div_(s.reshape(-1, 1).to(up.dtype))
            layer.down_proj.weight.mul_(s.to(layer.down_proj.weight.dtype))
            done += 1
    return done


def calibration_sequences(hf_dir, conversations: int = 32, max_tokens: int = 512,
                          progress=print, purpose: str = "smoothing for int8 rows"
                          ) -> list[list[int]]:
    """Chat-rendered ShareGPT conversations outside the held-out split (the training split's
    first `conversations`), each cut to `max_tokens` tokens: the text the smoothing factors
    are measured on."""
    from trt_spec.export.sharegpt import fetch_sharegpt, load_tokenizer, read_conversations, split

    tok = load_tokenizer(hf_dir)
    source, _ = read_conversations(fetch_sharegpt(), limit=conversations * 2)
    train, _ = split(source)
    texts = [tok.apply_chat_template(c.messages, add_generation_prompt=False)
             for c in train[:conversations]]
    sequences = [ids[:max_tokens] for ids in tok.encode_batch(texts, add_special_tokens=False)
                 if len(ids) >= 8]
    progress(f"{purpose}: {len(sequences)} ShareGPT training conversations, "
             f"{sum(map(len, sequences))} tokens")
    return sequences
