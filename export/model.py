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
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from trt_spec.plugins.attention import attention
from trt_spec.plugins.rms_norm import add_rms_norm, rms_norm
from trt_spec.plugins.spec_verify import spec_verify
from trt_spec.runtime.config import ModelConfig


def rope_tables(config: ModelConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin: [max_position_embeddings, head_dim / 2] (default Llama RoPE)."""
    inv_freq = 1.0 / config.rope_theta ** (
        torch.arange(0, config.head_dim, 2, dtype=torch.float64) / config.head_dim)
    angles = torch.outer(torch.arange(config.max_position_embeddings, dtype=torch.float64), inv_freq)
    return angles.cos().float(), angles.sin().float()


def add_rope_buffers(module: nn.Module, config: ModelConfig) -> None:
    """cos_cache, sin_cache: the RoPE tables every attention of `module` reads."""
    cos, sin = rope_tables(config)
    module.register_buffer("cos_cache", cos, persistent=False)
    module.register_buffer("sin_cache", sin, persistent=False)


def apply_head(x: torch.Tensor, embed: nn.Embedding, lm_head: nn.Linear | None) -> torch.Tensor:
    """x: [..., H] (already normed) -> logits; lm_head None: tied to the embedding."""
    return F.linear(x, embed.weight if lm_head is None else lm_head.weight)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, qkv_in: int | None = None):
        """qkv_in: width of the attention input (Eagle3's layer reads 2H); default H."""
        super().__init__()
        c = config
        self.config = c
        self.input_layernorm = nn.Parameter(torch.ones(c.hidden_size))
        self.qkv_proj = nn.Linear(qkv_in or c.hidden_size,
                                  (c.num_heads + 2 * c.num_kv_heads) * c.head_dim, bias=False)
        self.o_proj = nn.Linear(c.num_heads * c.head_dim, c.hidden_size, bias=False)
        self.post_attention_layernorm = nn.Parameter(torch.ones(c.hidden_size))
        self.gate_up_proj = nn.Linear(c.hidden_size, 2 * c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)

    # The attention op (plugins/attention.py: the reference eagerly, ORT's node under export).
    # The torch-cuda backend sets a shape-static, in-place form on its own copy of the module
    # (runtime/backends/torch_cuda.py); a strategy chosen once, not a value of the graph.
    attention_op = staticmethod(attention)

    def mlp(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class TargetModel(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_layers))
        self.norm = nn.Parameter(torch.ones(config.hidden_size))
        self.lm_head = (None if config.tie_word_embeddings
                        else nn.Linear(config.hidden_size, config.vocab_size, bias=False))
        add_rope_buffers(self, config)

    def head(self, x: torch.Tensor) -> torch.Tensor:
        """x: [..., H] (already normed) -> logits [..., vocab]."""
        return apply_head(x, self.embed_tokens, self.lm_head)

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
        x = rms_norm(h, self.layers[0].input_layernorm, c.rms_norm_eps)
        features, presents = {}, []
        for i, layer in enumerate(self.layers):
            features[i] = h  # the input to layer i
            a, present_k, present_v = layer.attention_op(
                layer.qkv_proj(x), past[2 * i], past[2 * i + 1], seqlens_k, query_seqlens,
                position_ids, total_sequence_length, self.cos_cache, self.sin_cache,
                c.num_heads, c.num_kv_heads)
            presents += [present_k, present_v]
            x, h = add_rms_norm(layer.o_proj(a), h, layer.post_attention_layernorm, c.rms_norm_eps)
            next_norm = (self.layers[i + 1].input_layernorm if i + 1 < c.num_layers else self.norm)
            x, h = add_rms_norm(layer.mlp(x), h, next_norm, c.rms_norm_eps)
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
        draft_probs  [batch, new_tokens, vocab] float32: q for the draft at input position
                     i + 1 in row i (the last row is unused; one-hot rows for a
                     deterministic drafter)
        uniforms     [batch, new_tokens] float32, temperature / top_p [batch] float32,
        top_k        [batch] int32
    Outputs: num_accepted [batch] int64, tokens [batch, new_tokens] int64, then the target's
    hidden_states, eagle3_features and presents.
    """

    def __init__(self, target: TargetModel):
        super().__init__()
        self.target = target
        self.config = target.config

    def forward(self, input_ids, position_ids, seqlens_k, query_seqlens, total_sequence_length,
                draft_probs, uniforms, temperature, top_k, top_p, *past):
        batch, new_tokens = input_ids.shape
        logits_index = torch.arange(new_tokens, device=input_ids.device).expand(batch, new_tokens)
        logits, hidden, eagle3, *presents = self.target(
            input_ids, position_ids, seqlens_k, query_seqlens, total_sequence_length,
            logits_index, *past)
        draft_lens = (query_seqlens - 1).clamp_min(0)  # (B,) idle rows: 0
        accepted, tokens = spec_verify(input_ids[:, 1:], draft_lens, logits,
                                       draft_probs[:, :-1], uniforms, temperature, top_k, top_p)
        return (accepted, tokens, hidden, eagle3, *presents)


def empty_cache(config: ModelConfig, batch: int, max_len: int,
                dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    shape = (batch, config.num_kv_heads, max_len, config.head_dim)
    return [torch.zeros(shape, dtype=dtype) for _ in range(2 * config.num_layers)]
