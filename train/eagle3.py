"""Training an Eagle3 head (EAGLE-3, Li et al. 2025) by self-distillation from the target.

The head is export/drafters.py's Eagle3Step + Eagle3Fc; this file adds a full-sequence
training forward with the same weights, the draft vocabulary, and the loss.

Training-time test (TTT). For every anchor a of a sequence x_0 .. x_{n-1} at once, unrolled
step j (0-based) computes the row the exported head computes at draft step j of a propose
whose anchor is a:

    step j, anchor a    position a + j
                        token    x_{a+j+1}          (teacher forced; the draft at inference)
                        hidden   fc(eagle3 features at a)  if j = 0,
                                 step j-1's next hidden at anchor a  otherwise
                        attends  step 0's rows 0 .. a  (causal)  and steps 1 .. j at anchor a
                        predicts x_{a+j+2}: soft labels = the target's distribution at
                                 position a+j+1, restricted to the draft vocabulary

which is what the runtime's cache holds: the committed rows 0 .. a, then the loop rows
a+1 .. a+j. Step j's loss counts anchors with a+j+2 < n whose predicted token is an assistant
token, and weighs step_decay ** j.

Draft vocabulary: the `size` most frequent tokens of the training text, in id order;
d2t[d] = target id - d (EAGLE's layout: target id = d + d2t[d]); t2d marks the target ids.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch
from torch.nn import functional as F

from trt_spec.export.drafter_checkpoint import layer_config
from trt_spec.export.drafters import Drafter, Eagle3Fc, Eagle3Step
from trt_spec.export.drafter_checkpoint import target_head
from trt_spec.export.model import TargetModel
from trt_spec.plugins.attention import rotate
from trt_spec.plugins.rms_norm import rms_norm
from trt_spec.train.features import FeatureStore
from trt_spec.train.loop import Batch

# --- the draft vocabulary -----------------------------------------------------------------


def token_counts(store: FeatureStore, vocab_size: int) -> np.ndarray:
    """[vocab] int64: occurrences of each token id in the stored sequences."""
    counts = np.zeros(vocab_size, dtype=np.int64)
    for shard in store.shards:
        ids = np.asarray(store.arrays(shard)["input_ids"])
        counts += np.bincount(ids, minlength=vocab_size)[:vocab_size]
    return counts


def draft_vocab(counts: np.ndarray, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """counts [vocab] -> (d2t [size] int64, t2d [vocab] bool). Ties (and unseen tokens, when
    the text has fewer than `size` distinct ones) go to the lower id."""
    vocab = len(counts)
    if not 1 <= size <= vocab:
        raise ValueError(f"draft vocabulary size {size}: must be in 1..{vocab} (the target's "
                         "vocabulary)")
    order = np.lexsort((np.arange(vocab), -counts))  # most frequent first, then lower id
    ids = torch.from_numpy(np.sort(order[:size])).long()
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[ids] = True
    return ids - torch.arange(size), t2d


def target_to_draft(d2t: torch.Tensor, vocab: int) -> torch.Tensor:
    """[vocab] int64: the draft id of each target id, -1 outside the draft vocabulary."""
    index = torch.full((vocab,), -1, dtype=torch.long)
    index[torch.arange(len(d2t)) + d2t] = torch.arange(len(d2t))
    return index


# --- a new head ---------------------------------------------------------------------------


def init_eagle3(target: TargetModel, d2t: torch.Tensor, seed: int = 0,
                feature_layers: tuple[int, ...] | None = None) -> Drafter:
    """A fresh head shaped like one target layer: random layer and fc; the target's embedding
    (frozen: save_drafter leaves it out and the loader takes the target's), final norm, and
    head rows of the draft vocabulary."""
    t = target.config
    config = layer_config({}, t)
    torch.manual_seed(seed)
    step = Eagle3Step(config, len(d2t))
    fc = Eagle3Fc(3 * t.hidden_size, config.hidden_size)
    ids = torch.arange(len(d2t)) + d2t
    with torch.no_grad():
        step.embed_tokens.weight.copy_(target.embed_tokens.weight)
        step.head_norm.copy_(target.norm)
        step.lm_head.weight.copy_(target_head(target)[ids])
    step.embed_tokens.weight.requires_grad_(False)
    return Drafter("eagle3", [step], fc, d2t.clone(), tuple(feature_layers or t.eagle3_layers))


# --- the training forward -----------------------------------------------------------------


def qkv_rows(step: Eagle3Step, tokens: torch.Tensor, hidden: torch.Tensor,
             positions: torch.Tensor):
    """tokens [B, T], hidden [B, T, H], positions [B, T] -> q [B, nh, T, hd],
    k, v [B, nh, T, hd] (kv heads repeated), RoPE applied."""
    c = step.config
    b, t = tokens.shape
    e = rms_norm(step.embed_tokens(tokens), step.layer.input_layernorm, c.rms_norm_eps)
    x = torch.cat([e, rms_norm(hidden, step.hidden_norm, c.rms_norm_eps)], -1)  # (B, T, 2H)
    q, k, v = step.layer.qkv_proj(x).split(
        [c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.num_kv_heads * c.head_dim], -1)
    cos = step.cos_cache[positions].unsqueeze(1)  # (B, 1, T, hd/2)
    sin = step.sin_cache[positions].unsqueeze(1)
    group = c.num_heads // c.num_kv_heads
    q = rotate(q.view(b, t, c.num_heads, c.head_dim).transpose(1, 2), cos, sin)
    k = rotate(k.view(b, t, c.num_kv_heads, c.head_dim).transpose(1, 2), cos, sin)
    v = v.view(b, t, c.num_kv_heads, c.head_dim).transpose(1, 2)
    return q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)


def shift(x: torch.Tensor, n: int) -> torch.Tensor:
    """x[:, p] <- x[:, p + n] along dim 1, zero-filled at the end. x: [B, T, ...]."""
    if n == 0:
        return x
    return torch.cat([x[:, n:], torch.zeros_like(x[:, :n])], 1)


def unroll(drafter: Drafter, input_ids: torch.Tensor, eagle3: torch.Tensor, steps: int):
    """input_ids [B, T]; eagle3 [B, T, 3H] -> per step j a pair (logits [B, T, draft_vocab],
    next hidden [B, T, H]) for every anchor a (rows with a + j + 1 >= T are padding)."""
    step = drafter.modules[0]
    c = step.config
    b, t = input_ids.shape
    anchors = torch.arange(t, device=input_ids.device).expand(b, t)
    causal = torch.ones(t, t, dtype=torch.bool, device=input_ids.device).tril()  # key <= anchor
    scale = c.head_dim ** -0.5
    hidden = drafter.fc(eagle3)  # (B, T, H)
    k0 = v0 = None  # step 0's keys / values [B, nh, T, hd]: read causally
    diag_k, diag_v = [], []  # steps 1..j, [B, nh, T, hd] each: read at their own anchor only
    out = []
    for j in range(steps):
        q, k, v = qkv_rows(step, shift(input_ids, j + 1), hidden, anchors + j)
        if j == 0:
            k0, v0 = k, v
        else:
            diag_k.append(k)
            diag_v.append(v)
        scores = ((q @ k0.transpose(-1, -2)) * scale).masked_fill(~causal, float("-inf"))
        extra = [(q * kd).sum(-1, keepdim=True) * scale for kd in diag_k]  # (B, nh, T, 1) each
        weights = torch.cat([scores, *extra], -1).softmax(-1)  # (B, nh, T, T + j)
        a = weights[..., :t] @ v0
        for i, vd in enumerate(diag_v):
            a = a + weights[..., t + i:t + i + 1] * vd
        a = a.transpose(1, 2).reshape(b, t, c.num_heads * c.head_dim)
        h = hidden + step.layer.o_proj(a)
        h = h + step.layer.mlp(rms_norm(h, step.layer.post_attention_layernorm, c.rms_norm_eps))
        out.append((step.head(rms_norm(h, step.head_norm, c.rms_norm_eps)), h))
        hidden = h
    return out


# --- the loss ---------------------------------------------------------------------------


def soft_labels(topk_ids: torch.Tensor, topk_probs: torch.Tensor, t2d_index: torch.Tensor):
    """topk_ids, topk_probs [B, T, k] (target ids) -> (draft ids [B, T, k] (0 where outside),
    probs [B, T, k] renormalised over the draft vocabulary, has_mass [B, T] bool)."""
    draft = t2d_index[topk_ids]  # (B, T, k), -1 outside
    inside = draft >= 0
    p = topk_probs * inside
    mass = p.sum(-1, keepdim=True)
    return draft.clamp(min=0), p / mass.clamp(min=1e-12), mass[..., 0] > 0


def eagle3_loss(drafter: Drafter, batch: Batch, t2d_index: torch.Tensor, steps: int,
                step_decay: float) -> tuple[torch.Tensor, dict]:
    """Soft cross entropy per unrolled step (see the module docstring), and per step the
    accuracy: the head's argmax is the target's argmax (top-1 of the stored top-k)."""
    b, t = batch.input_ids.shape
    rows = torch.arange(t, device=batch.input_ids.device)
    total, metrics = 0.0, {}
    d2t_ids = torch.arange(len(drafter.d2t), device=rows.device) + drafter.d2t.to(rows.device)
    for j, (logits, _) in enumerate(unroll(drafter, batch.input_ids, batch.eagle3, steps)):
        ids, probs, has_mass = soft_labels(shift(batch.topk_ids, j + 1),
                                           shift(batch.topk_probs, j + 1), t2d_index)
        # anchor a predicts x_{a+j+2}: it must exist and be an assistant token
        valid = (rows + j + 2 < batch.lengths[:, None]) & shift(batch.loss_mask, j + 2)
        weight = (valid & has_mass).float()  # (B, T)
        logp = logits.float().log_softmax(-1)  # (B, T, draft_vocab)
        ce = -(probs * logp.gather(-1, ids)).sum(-1)  # (B, T)
        n = weight.sum().clamp(min=1)
        loss_j = (ce * weight).sum() / n
        total = total + step_decay ** j * loss_j
        hit = d2t_ids[logits.argmax(-1)] == shift(batch.topk_ids, j + 1)[..., 0]
        metrics[f"loss_{j}"] = float(loss_j.detach())
        metrics[f"acc_{j}"] = float((hit.float() * valid).sum() / valid.float().sum().clamp(min=1))
    metrics["loss"] = float(total.detach())
    return total, metrics


def to_device(drafter: Drafter, device: str) -> Drafter:
    for m in drafter.modules + [drafter.fc]:
        m.to(device)
    return drafter


# --- the run ----------------------------------------------------------------------------


def train_eagle3(store: FeatureStore, target: TargetModel, out, config, draft_vocab_size: int,
                 resume: bool = False, device: str = "cpu", log=None,
                 max_steps: int | None = None) -> dict:
    """Trains a head on `store`; the training state is `out/eagle3-state.pt` (every
    config.checkpoint_every steps), the head `out/eagle3/` (save_drafter) when this run stops.
    Returns the loop's metrics plus the draft vocabulary's coverage of the training tokens."""
    from pathlib import Path

    from trt_spec.export.drafter_checkpoint import save_drafter
    from trt_spec.train.loop import train_loop

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    vocab = target.config.vocab_size
    if tuple(store.feature_layers) != tuple(target.config.eagle3_layers):
        raise ValueError(f"features were taken at layers {store.feature_layers}, the target "
                         f"reads {target.config.eagle3_layers}")
    counts = token_counts(store, vocab)
    d2t, t2d = draft_vocab(counts, draft_vocab_size)
    drafter = to_device(init_eagle3(target, d2t, config.seed, store.feature_layers), device)
    t2d_index = target_to_draft(d2t, vocab).to(device)
    extra = {"kind": "eagle3", "plan": store.manifest["plan"], "shards": store.shards,
             "draft_vocab": draft_vocab_size}
    metrics = train_loop(
        store, {"fc": drafter.fc, "step": drafter.modules[0]},
        lambda batch: eagle3_loss(drafter, batch, t2d_index, config.ttt_steps,
                                  config.step_decay),
        config, out / "eagle3-state.pt", extra, resume, device, log, max_steps)
    save_drafter(to_device(drafter, "cpu").eval(), out / "eagle3")
    metrics["draft_vocab_coverage"] = float(counts[t2d.numpy()].sum() / max(1, counts.sum()))
    return metrics


@torch.no_grad()
def evaluate_eagle3(store: FeatureStore, target: TargetModel, head_dir, config,
                    device: str = "cpu") -> dict:
    """The saved head's loss and per-step accuracy over `store` (held-out features), token-
    weighted over batches of config.batch_size sequences."""
    from trt_spec.export.drafter_checkpoint import load_drafter
    from trt_spec.train.loop import collate

    drafter = to_device(load_drafter(head_dir, "eagle3", target), device).eval()
    t2d_index = target_to_draft(drafter.d2t, target.config.vocab_size).to(device)
    sums, weight = {}, 0
    for lo in range(0, len(store), config.batch_size):
        batch = collate([store[i] for i in range(lo, min(lo + config.batch_size, len(store)))],
                        device)
        _, metrics = eagle3_loss(drafter, batch, t2d_index, config.ttt_steps, config.step_decay)
        n = int(batch.loss_mask.sum())
        weight += n
        for k, v in metrics.items():
            sums[k] = sums.get(k, 0.0) + v * n
    return {k: v / max(weight, 1) for k, v in sums.items()}
