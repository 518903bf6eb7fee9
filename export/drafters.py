"""Drafter modules written for export: the MTP module (Eagle is one of them, looped) and the
Eagle3 head. Pure forwards like the target: every changing value is an input, and each module
has its own one-layer KV cache, preallocated and updated in place.

Row p of a drafter's cache sits at position p and reads the token after it, x_{p+1}, with a
hidden state of position p; its logits predict the token after that.

    MTP module i / Eagle (DeepSeek-V3 layout; embedding first)
        h    = eh_proj(concat(enorm(embed(x_{p+i+1})), hnorm(hidden_p)))     # 2H -> H
        h    = decoder_layer(h)                                                # one Llama layer
        out  = head(head_norm(h))      head: the module's shared_head, or the target's norm + lm_head
        next_hidden_states = h         (module i+1's input at the same row; Eagle's next row)

    Eagle3 (EAGLE-3; embedding first)
        g    = fc(concat(features of target layers (2, L/2, L-3)))       # first step only: Eagle3Fc
        a    = attention(qkv_proj(concat(input_layernorm(embed(tok)), hidden_norm(g))))  # 2H wide
        h    = g + o_proj(a);  h = h + mlp(post_attention_layernorm(h))
               (norm_before_residual, speculators' option: hidden_norm(g) + o_proj(a))
        out  = lm_head(norm(h))  over the draft vocabulary; target id = draft id + d2t[draft id]
        next_hidden_states = h         (the next step's g)

A reduced draft vocabulary (`restrict_head`, export --draft-vocab) gives an MTP / Eagle module
or a vanilla draft the same kind of head: the head's rows at the draft vocabulary's target
ids, so its logits are [.., draft_vocab] and map to target ids as Eagle3's do. The embedding
stays full: input ids are target ids.

Graph contract (engines/README.md documents it for users): the target's inputs with one layer
of past, plus `hidden_states` [batch, new_tokens, H]; outputs `logits` [batch, num_logits,
vocab], `next_hidden_states` [batch, new_tokens, H] and the present key/value.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from trt_spec.export.model import DecoderLayer, add_rope_buffers, apply_head
from trt_spec.plugins.rms_norm import rms_norm
from trt_spec.runtime.config import ModelConfig
from trt_spec.runtime.methods import HEAD_METHODS, METHODS

KINDS = HEAD_METHODS  # runtime/methods.py: the methods whose drafter is a head


def head_vocab(module: nn.Module) -> int:
    """The width of a target's or drafter's logits: its lm_head's rows, else (tied) the
    embedding's."""
    return (module.embed_tokens.num_embeddings if module.lm_head is None
            else module.lm_head.out_features)


def restrict_head(module: nn.Module, d2t: torch.Tensor) -> None:
    """In place: the module's head keeps only the rows of the draft vocabulary, `d2t`
    [draft_vocab] int64 (target id = draft id + d2t[draft id]), so logits column d is the
    full head's column d + d2t[d]. A tied head becomes an lm_head of the embedding's rows;
    the embedding itself stays full. `module`: a TargetModel (a vanilla draft) or an MTP /
    Eagle module (anything with embed_tokens, lm_head and head())."""
    assert d2t.dim() == 1 and d2t.dtype == torch.int64, (d2t.shape, d2t.dtype)
    full = module.embed_tokens.weight if module.lm_head is None else module.lm_head.weight
    assert full.shape[0] == module.embed_tokens.num_embeddings, "the head is already restricted"
    ids = torch.arange(len(d2t)) + d2t
    assert 0 <= int(ids.min()) and int(ids.max()) < full.shape[0], "d2t outside the head"
    head = nn.Linear(full.shape[1], len(ids), bias=False, dtype=full.dtype, device=full.device)
    with torch.no_grad():
        head.weight.copy_(full[ids.to(full.device)])
    module.lm_head = head


def take_rows(x: torch.Tensor, logits_index: torch.Tensor) -> torch.Tensor:
    """x: [batch, new_tokens, H]; logits_index: [batch, num_logits] -> [batch, num_logits, H]."""
    index = logits_index.unsqueeze(-1).expand(-1, -1, x.shape[-1])
    return torch.gather(x, 1, index)


class OneLayerDrafter(nn.Module):
    """What MTP and Eagle3 share: one decoder layer over its own cache, then a norm and a head."""

    def __init__(self, config: ModelConfig, head_vocab: int, qkv_in: int | None = None):
        super().__init__()
        assert config.num_layers == 1, config.num_layers
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layer = DecoderLayer(config, qkv_in)
        self.head_norm = nn.Parameter(torch.ones(config.hidden_size))
        tied = config.tie_word_embeddings and head_vocab == config.vocab_size
        self.lm_head = None if tied else nn.Linear(config.hidden_size, head_vocab, bias=False)
        add_rope_buffers(self, config)

    def head(self, x: torch.Tensor) -> torch.Tensor:
        return apply_head(x, self.embed_tokens, self.lm_head)

    def layer_input(self, input_ids: torch.Tensor, hidden_states: torch.Tensor):
        """input_ids [B, T], hidden_states [B, T, H] -> (the attention's input [B, T, qkv_in],
        already normed; the residual [B, T, H]). What MTP and Eagle3 differ in."""
        raise NotImplementedError

    def attend(self, attn_in, residual, position_ids, seqlens_k, query_seqlens,
               total_sequence_length, logits_index, past_key, past_value):
        """attn_in: [B, T, qkv_in] (normed); residual: [B, T, H] ->
        (logits [B, N, head_vocab], next_hidden_states [B, T, H], present_key, present_value)."""
        layer = self.layer
        a, present_k, present_v = layer.attend(
            attn_in, past_key, past_value, seqlens_k, query_seqlens, position_ids,
            total_sequence_length, self.cos_cache, self.sin_cache)
        x, h = layer.residual(a, residual, self.head_norm)
        return self.head(take_rows(x, logits_index)), h, present_k, present_v


class MTPModule(OneLayerDrafter):
    """A DeepSeek-V3 MTP module; Eagle is one of these run in a loop."""

    def __init__(self, config: ModelConfig):
        super().__init__(config, config.vocab_size)
        h = config.hidden_size
        self.enorm = nn.Parameter(torch.ones(h))
        self.hnorm = nn.Parameter(torch.ones(h))
        self.eh_proj = nn.Linear(2 * h, h, bias=False)

    def forward(
        self,
        input_ids: torch.Tensor,  # [batch, new_tokens] int64: x_{p+i+1}
        hidden_states: torch.Tensor,  # [batch, new_tokens, H]: target's (or module i-1's) at p
        position_ids: torch.Tensor,  # [batch, new_tokens] int64
        seqlens_k: torch.Tensor,  # [batch] int32
        query_seqlens: torch.Tensor,  # [batch] int32
        total_sequence_length: torch.Tensor,  # [] int32
        logits_index: torch.Tensor,  # [batch, num_logits] int64
        past_key: torch.Tensor,  # [batch, kv_heads, max_len, head_dim]
        past_value: torch.Tensor,  # [batch, kv_heads, max_len, head_dim]
    ):
        return self.attend(*self.layer_input(input_ids, hidden_states), position_ids, seqlens_k,
                           query_seqlens, total_sequence_length, logits_index, past_key,
                           past_value)

    def layer_input(self, input_ids, hidden_states):
        """-> (attention input [B, T, H] (normed), residual [B, T, H])."""
        c = self.config
        e = rms_norm(self.embed_tokens(input_ids), self.enorm, c.rms_norm_eps)
        h = self.eh_proj(torch.cat([e, rms_norm(hidden_states, self.hnorm, c.rms_norm_eps)], -1))
        return rms_norm(h, self.layer.input_layernorm, c.rms_norm_eps), h


class Eagle3Step(OneLayerDrafter):
    """One Eagle3 draft step: its attention reads 2H, its head the draft vocabulary.
    norm_before_residual (speculators' option): the residual is hidden_norm(g), not g."""

    def __init__(self, config: ModelConfig, draft_vocab_size: int,
                 norm_before_residual: bool = False):
        super().__init__(config, draft_vocab_size, qkv_in=2 * config.hidden_size)
        self.hidden_norm = nn.Parameter(torch.ones(config.hidden_size))
        self.norm_before_residual = norm_before_residual

    def forward(self, input_ids, hidden_states, position_ids, seqlens_k, query_seqlens,
                total_sequence_length, logits_index, past_key, past_value):
        """As MTPModule.forward; hidden_states [batch, new_tokens, H] is g: fc(features) on
        the first step, the previous step's next_hidden_states after."""
        return self.attend(*self.layer_input(input_ids, hidden_states), position_ids, seqlens_k,
                           query_seqlens, total_sequence_length, logits_index, past_key,
                           past_value)

    def layer_input(self, input_ids, hidden_states):
        """-> (attention input [B, T, 2H] (normed), residual [B, T, H]: hidden_states, or
        hidden_norm(hidden_states) when norm_before_residual)."""
        c = self.config
        e = rms_norm(self.embed_tokens(input_ids), self.layer.input_layernorm, c.rms_norm_eps)
        g = rms_norm(hidden_states, self.hidden_norm, c.rms_norm_eps)
        return torch.cat([e, g], -1), g if self.norm_before_residual else hidden_states


class Eagle3Fc(nn.Module):
    """features [batch, new_tokens, 3H_target] -> hidden_states [batch, new_tokens, H]."""

    def __init__(self, in_features: int, hidden_size: int, bias: bool = False):
        super().__init__()
        self.fc = nn.Linear(in_features, hidden_size, bias=bias)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.fc(features)


@dataclass
class Drafter:
    """A loaded drafter: what the exporter writes into an engine folder."""

    kind: str  # one of KINDS
    modules: list[OneLayerDrafter]  # mtp: N modules; eagle: 1; eagle3: [Eagle3Step]
    fc: Eagle3Fc | None = None  # eagle3 only
    # [draft_vocab] int64: the head's draft vocabulary, target id = draft id + d2t[draft id].
    # Eagle3 always; MTP / Eagle after restrict_head; None: the head spans the target's.
    d2t: torch.Tensor | None = None
    feature_layers: tuple[int, ...] = ()  # eagle3: target layers whose inputs fc fuses

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"drafter kind {self.kind!r}; known: {', '.join(KINDS)}")
        method = METHODS[self.kind]
        if method.looped and len(self.modules) != 1:
            raise ValueError(f"an {self.kind} drafter has one module, not {len(self.modules)}")
        if (method.fc_graph and self.fc is None) or (method.own_vocab and self.d2t is None):
            raise ValueError(f"an {self.kind} drafter needs fc and d2t")

    @property
    def config(self) -> ModelConfig:
        return self.modules[0].config

    def eval(self) -> "Drafter":
        for m in self.modules + ([self.fc] if self.fc is not None else []):
            m.eval()
        return self
