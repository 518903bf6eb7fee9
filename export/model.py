"""The target model, written for export: a pure forward, every changing value an input,
the KV cache preallocated and passed in.

Graph contract (engines/README.md documents it for users):

    inputs                                         outputs
    input_ids             [batch, new_tokens] i64   logits            [batch, num_logits, vocab]
    position_ids          [batch, new_tokens] i64   hidden_states     [batch, new_tokens, H]
    seqlens_k             [batch] i32               eagle3_features   [batch, new_tokens, 3H]
    query_seqlens         [batch] i32               present.{i}.key   (same buffer as past)
    total_sequence_length [] i32                    present.{i}.value
    logits_index          [batch, num_logits] i64
    past_key_values.{i}.key / .value  [batch, kv_heads, max_len, head_dim]

`hidden_states` is the last layer's output after the final norm (what lm_head reads; the
MTP / Eagle input). `eagle3_features` concatenates the inputs to `config.eagle3_layers`.
Logits are computed only at `logits_index` (the last prompt token at prefill, every
position at verification), so a long prefill does not pay for a vocab-sized output per token.

One decoder for every family: what Qwen2 / Qwen3 / Gemma 3 change is a ModelConfig flag read
in one place here (runtime/config.py lists them):

    h = embed(ids) * embed_scale                                   # Gemma: sqrt(H)
    per layer i:
        x   = norm(h)
        qkv = qkv_proj(x) (+ bias: Qwen2);  q, k = head_norm(q), head_norm(k)   # qk_norm
        a   = attention(qkv, rope of layer i, window of layer i)   # sliding / full, 2 bases
        a   = norm(o_proj(a))            if sandwich_norm (Gemma)  else o_proj(a)
        h   = h + a;  x = norm(h)
        m   = down(act(gate(x)) * up(x))                           # act: silu | gelu_tanh
        m   = norm(m)                    if sandwich_norm          else m
        h   = h + m
    logits = head(norm(h)), softcapped c * tanh(logits / c) when logit_softcap > 0
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from trt_spec.export import rope
from trt_spec.plugins.attention import Heads, attention
from trt_spec.plugins.rms_norm import add_rms_norm, rms_norm
from trt_spec.plugins.spec_verify import spec_verify
from trt_spec.runtime.config import ModelConfig, RopeScaling


def rope_tables(config: ModelConfig,
                theta: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin: [max_position_embeddings, rotary_dim / 2], config.rope_scaling applied
    (export/rope.py); a `theta` other than config.rope_theta (a sliding layer's local base)
    gets the plain RoPE."""
    local = theta is not None and theta != config.rope_theta
    return rope.rope_tables(config, theta, RopeScaling() if local else None)


def add_rope_buffers(module: nn.Module, config: ModelConfig) -> None:
    """cos_cache, sin_cache: the RoPE tables the attention of `module` reads; plus cos_local,
    sin_local (base rope_local_theta) when the sliding layers have their own base (Gemma 3)."""
    cos, sin = rope_tables(config)
    module.register_buffer("cos_cache", cos, persistent=False)
    module.register_buffer("sin_cache", sin, persistent=False)
    if has_local_rope(config):
        cos, sin = rope_tables(config, config.rope_local_theta)
        module.register_buffer("cos_local", cos, persistent=False)
        module.register_buffer("sin_local", sin, persistent=False)


def has_local_rope(config: ModelConfig) -> bool:
    return (config.rope_local_theta > 0 and config.rope_local_theta != config.rope_theta
            and "sliding_attention" in config.layer_types)


def layer_rope(module: nn.Module, config: ModelConfig, i: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Layer i's RoPE tables (cos, sin) among `module`'s buffers (add_rope_buffers)."""
    if config.layer_window(i) and has_local_rope(config):
        return module.cos_local, module.sin_local
    return module.cos_cache, module.sin_cache


def apply_head(x: torch.Tensor, embed: nn.Embedding, lm_head: nn.Linear | None) -> torch.Tensor:
    """x: [..., H] (already normed) -> logits; lm_head None: tied to the embedding."""
    return F.linear(x, embed.weight if lm_head is None else lm_head.weight)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, qkv_in: int | None = None, index: int = 0):
        """qkv_in: width of the attention input (Eagle3's layer reads 2H); default H.
        index: the layer's place in the model (its window and RoPE base follow layer_types)."""
        super().__init__()
        c = config
        self.config = c
        self.window = c.layer_window(index)  # 0: full causal attention
        self.input_layernorm = nn.Parameter(torch.ones(c.hidden_size))
        self.qkv_proj = nn.Linear(qkv_in or c.hidden_size,
                                  (c.num_heads + 2 * c.num_kv_heads) * c.head_dim,
                                  bias=c.attention_bias)
        if c.qk_norm:  # one RMS norm weight over head_dim, shared by every q (k) head
            self.q_norm = nn.Parameter(torch.ones(c.head_dim))
            self.k_norm = nn.Parameter(torch.ones(c.head_dim))
        self.o_proj = nn.Linear(c.num_heads * c.head_dim, c.hidden_size, bias=False)
        self.post_attention_layernorm = nn.Parameter(torch.ones(c.hidden_size))  # the MLP's input norm
        if c.sandwich_norm:  # Gemma's post_attention_layernorm / post_feedforward_layernorm
            self.attn_output_norm = nn.Parameter(torch.ones(c.hidden_size))
            self.mlp_output_norm = nn.Parameter(torch.ones(c.hidden_size))
        self.gate_up_proj = nn.Linear(c.hidden_size, 2 * c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)

    # The attention op (plugins/attention.py: the reference eagerly, ORT's node under export).
    # The torch-cuda backend sets a shape-static, in-place form on its own copy of the module
    # (export/torch_backend.py); a strategy chosen once, not a value of the graph.
    attention_op = staticmethod(attention)

    def qkv(self, x: torch.Tensor) -> torch.Tensor:
        """x [B, T, qkv_in] (normed) -> packed qkv [B, T, (nh + 2 kvh) hd], q and k heads
        RMS-normed when qk_norm (RoPE comes after, inside the attention op)."""
        c = self.config
        qkv = self.qkv_proj(x)
        if not c.qk_norm:
            return qkv
        batch, new_tokens, _ = qkv.shape
        q, k, v = qkv.split([c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim,
                             c.num_kv_heads * c.head_dim], dim=-1)
        q = rms_norm(q.reshape(batch, new_tokens, c.num_heads, c.head_dim), self.q_norm,
                     c.rms_norm_eps)  # (B, T, nh, hd)
        k = rms_norm(k.reshape(batch, new_tokens, c.num_kv_heads, c.head_dim), self.k_norm,
                     c.rms_norm_eps)  # (B, T, kvh, hd)
        return torch.cat([q.flatten(2), k.flatten(2), v], dim=-1)

    def attend(self, x, past_key, past_value, seqlens_k, query_seqlens, position_ids,
               total_sequence_length, cos, sin):
        """x [B, T, qkv_in] (normed) -> (attention output [B, T, nh hd], present_key,
        present_value)."""
        c = self.config
        return self.attention_op(self.qkv(x), past_key, past_value, seqlens_k, query_seqlens,
                                 position_ids, total_sequence_length, cos, sin,
                                 Heads(c.num_heads, c.num_kv_heads, self.window))

    def residual(self, a: torch.Tensor, h: torch.Tensor,
                 next_norm: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The rest of the layer after attention. a: attention output [B, T, nh hd]; h:
        residual [B, T, H]; next_norm: the norm weight of what reads the output (the next
        layer's input norm, or the final norm) -> (next_norm(h'), h') with h' the layer's
        output."""
        c = self.config
        o = self.o_proj(a)
        if c.sandwich_norm:
            o = rms_norm(o, self.attn_output_norm, c.rms_norm_eps)
        x, h = add_rms_norm(o, h, self.post_attention_layernorm, c.rms_norm_eps)
        m = self.mlp(x)
        if c.sandwich_norm:
            m = rms_norm(m, self.mlp_output_norm, c.rms_norm_eps)
        return add_rms_norm(m, h, next_norm, c.rms_norm_eps)

    def mlp(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        act = F.silu(gate) if self.config.hidden_act == "silu" else F.gelu(gate, approximate="tanh")
        return self.down_proj(act * up)


class TargetModel(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, index=i)
                                    for i in range(config.num_layers))
        self.norm = nn.Parameter(torch.ones(config.hidden_size))
        self.lm_head = (None if config.tie_word_embeddings
                        else nn.Linear(config.hidden_size, config.vocab_size, bias=False))
        add_rope_buffers(self, config)

    def head(self, x: torch.Tensor) -> torch.Tensor:
        """x: [..., H] (already normed) -> logits [..., vocab], softcapped if configured."""
        logits = apply_head(x, self.embed_tokens, self.lm_head)
        cap = self.config.logit_softcap
        return torch.tanh(logits / cap) * cap if cap > 0 else logits

    def forward(
        self,
        input_ids: torch.Tensor,  # [batch, new_tokens] int64
        position_ids: torch.Tensor,  # [batch, new_tokens] int64
        seqlens_k: torch.Tensor,  # [batch] int32
        query_seqlens: torch.Tensor,  # [batch] int32
        total_sequence_length: torch.Tensor,  # [] int32
        logits_index: torch.Tensor,  # [batch, num_logits] int64
        *past: torch.Tensor,  # 2L x [batch, kv_heads, max_len, head_dim], key then value
    ):
        c = self.config
        assert len(past) == 2 * c.num_layers, len(past)
        h = self.embed_tokens(input_ids)  # (B, T, H) residual stream
        if c.embed_scale != 1.0:
            h = h * c.embed_scale
        x = rms_norm(h, self.layers[0].input_layernorm, c.rms_norm_eps)
        features, presents = {}, []
        for i, layer in enumerate(self.layers):
            features[i] = h  # the input to layer i
            a, present_k, present_v = layer.attend(
                x, past[2 * i], past[2 * i + 1], seqlens_k, query_seqlens, position_ids,
                total_sequence_length, *layer_rope(self, c, i))
            presents += [present_k, present_v]
            next_norm = (self.layers[i + 1].input_layernorm if i + 1 < c.num_layers else self.norm)
            x, h = layer.residual(a, h, next_norm)
        # x is now the final-normed hidden state.
        index = logits_index.unsqueeze(-1).expand(-1, -1, c.hidden_size)  # (B, N, H)
        logits = self.head(torch.gather(x, 1, index))
        eagle3 = torch.cat([features[i] for i in c.eagle3_layers], dim=-1)
        return (logits, x, eagle3, *presents)


class TargetScorer(nn.Module):
    """The target's score step with the verifier inside: returns accepted counts and tokens
    instead of vocab-sized logits (plugins/spec_verify.py has the semantics).

    Row b holds [last token, d_1 .. d_n] with n = query_seqlens[b] - 1 drafts (rows may
    differ; right padding past them). Inputs as TargetModel without logits_index, plus
        seed         [batch] int64 (uint64 bits), position [batch] int64: the output
                     position of row 0 (the race's noise, runtime/race.py)
        temperature / top_p [batch] float32, top_k [batch] int32
    Outputs: num_accepted [batch] int64, tokens [batch, new_tokens] int64, then the target's
    hidden_states, eagle3_features and presents.
    """

    def __init__(self, target: TargetModel):
        super().__init__()
        self.target = target
        self.config = target.config

    def forward(self, input_ids, position_ids, seqlens_k, query_seqlens, total_sequence_length,
                seed, position, temperature, top_k, top_p, *past):
        batch, new_tokens = input_ids.shape
        logits_index = torch.arange(new_tokens, device=input_ids.device).expand(batch, new_tokens)
        logits, hidden, eagle3, *presents = self.target(
            input_ids, position_ids, seqlens_k, query_seqlens, total_sequence_length,
            logits_index, *past)
        draft_lens = (query_seqlens - 1).clamp_min(0)  # (B,) idle rows: 0
        accepted, tokens = spec_verify(input_ids[:, 1:], draft_lens, logits, seed, position,
                                       temperature, top_k, top_p)
        return (accepted, tokens, hidden, eagle3, *presents)


def empty_cache(config: ModelConfig, batch: int, max_len: int,
                dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    shape = (batch, config.num_kv_heads, max_len, config.head_dim)
    return [torch.zeros(shape, dtype=dtype) for _ in range(2 * config.num_layers)]
