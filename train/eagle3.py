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


import numpy as np
import torch

from trt_spec.export.published_heads import layer_config, target_head
from trt_spec.export.drafters import Drafter, Eagle3Fc, Eagle3Step
from trt_spec.export.model import TargetModel
from trt_spec.train.curve import CHAIN, chain_accept, make_curve
from trt_spec.train.features import FeatureStore
from trt_spec.train.loop import Batch, RunControl
from trt_spec.train.unroll import distill_loss, top1_hits, unroll

# --- the draft vocabulary -----------------------------------------------------------------


def token_counts(store: FeatureStore, vocab_size: int) -> np.ndarray:
    """[vocab] int64: occurrences of each token id in the stored sequences."""
    if hasattr(store, "token_counts"):
        return store.token_counts(vocab_size)
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
                feature_layers: tuple[int, ...] | None = None,
                intermediate_size: int | None = None) -> Drafter:
    """A fresh head shaped like one target layer: random layer and fc; the target's embedding
    (frozen: save_drafter leaves it out and the loader takes the target's), final norm, and
    head rows of the draft vocabulary. intermediate_size: the layer's MLP width (default the
    target's)."""
    t = target.config
    config = layer_config({"intermediate_size": intermediate_size} if intermediate_size else {}, t)
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


# --- the loss ---------------------------------------------------------------------------


def eagle3_loss(drafter: Drafter, batch: Batch, t2d_index: torch.Tensor, steps: int,
                step_decay: float, chain: bool = False) -> tuple[torch.Tensor, dict]:
    """Soft cross entropy per unrolled step (see the module docstring), weighed
    step_decay ** j, and per step the accuracy (the head's argmax is the target's); chain:
    also train/curve.py's chain acceptance accept_j of the `steps` steps."""
    d2t_ids = torch.arange(len(drafter.d2t), device=batch.input_ids.device)
    d2t_ids = d2t_ids + drafter.d2t.to(d2t_ids.device)
    hidden = drafter.fc(batch.eagle3)  # (B, T, H)
    total, metrics, hits = 0.0, {}, []
    for j, (logits, _) in enumerate(unroll(drafter.modules[0], batch.input_ids, hidden, steps)):
        loss_j, acc_j = distill_loss(logits, batch, j, t2d_index, d2t_ids)
        total = total + step_decay ** j * loss_j
        metrics[f"loss_{j}"] = float(loss_j.detach())
        metrics[f"acc_{j}"] = acc_j
        if chain:
            hits.append(top1_hits(logits, batch, j, d2t_ids))
    metrics["loss"] = float(total.detach())
    if chain:
        metrics.update(chain_accept(hits))
    return total, metrics


def to_device(drafter: Drafter, device: str) -> Drafter:
    for m in drafter.modules + [drafter.fc]:
        m.to(device)
    return drafter


# --- the run ----------------------------------------------------------------------------


def fine_tuned_eagle3(folder, target: TargetModel, feature_layers: tuple[int, ...]) -> Drafter:
    """A saved head to train further (--init-from): its draft vocabulary stays; the
    embedding (the target's) stays frozen, every other weight trains."""
    from trt_spec.export.drafter_checkpoint import load_drafter

    drafter = load_drafter(folder, "eagle3", target)
    if tuple(drafter.feature_layers) != tuple(feature_layers):
        raise ValueError(f"{folder}: the head reads layers {list(drafter.feature_layers)}, the "
                         f"features are taken at {list(feature_layers)}")
    for m in drafter.modules + [drafter.fc]:
        m.float().train()
        for name, p in m.named_parameters():
            p.requires_grad_(not name.startswith("embed_tokens"))
    return drafter


def train_eagle3(store: FeatureStore, target: TargetModel, out, config, draft_vocab_size: int,
                 run: RunControl = RunControl(), intermediate_size: int | None = None,
                 heldout=None, init=None) -> dict:
    """Trains a head on `store` as `run` says (train/loop.py RunControl); the training state is `out/eagle3-state.pt` (every
    config.checkpoint_every steps), the head `out/eagle3/` (save_drafter) when this run stops,
    the learning curve on `heldout` `out/eagle3-curve.jsonl` (config.eval_every > 0).
    init: a saved head's folder to start from (its draft vocabulary and MLP width), else a
    fresh one. Returns the loop's metrics plus the draft vocabulary's coverage of the
    training tokens."""
    from pathlib import Path

    from trt_spec.export.drafter_checkpoint import save_drafter
    from trt_spec.train.loop import train_loop

    out, device = Path(out), run.device
    out.mkdir(parents=True, exist_ok=True)
    vocab = target.config.vocab_size
    if tuple(store.feature_layers) != tuple(target.config.eagle3_layers):
        raise ValueError(f"features were taken at layers {store.feature_layers}, the target "
                         f"reads {target.config.eagle3_layers}")
    counts = token_counts(store, vocab)
    if init is not None:
        drafter = to_device(fine_tuned_eagle3(init, target, store.feature_layers), device)
        d2t = drafter.d2t.cpu()
        t2d = torch.zeros(vocab, dtype=torch.bool)
        t2d[torch.arange(len(d2t)) + d2t] = True
        draft_vocab_size = len(d2t)
    else:
        d2t, t2d = draft_vocab(counts, draft_vocab_size)
        drafter = to_device(init_eagle3(target, d2t, config.seed, store.feature_layers,
                                        intermediate_size), device)
    t2d_index = target_to_draft(d2t, vocab).to(device)
    extra = {"kind": "eagle3", "plan": store.manifest["plan"], "shards": store.shards,
             "draft_vocab": draft_vocab_size, "intermediate_size": drafter.config.intermediate_size,
             "init": str(init) if init is not None else None}
    curve = make_curve(config, heldout, lambda batch: eagle3_loss(
        drafter, batch, t2d_index, max(config.ttt_steps, CHAIN), config.step_decay, chain=True),
        out / "eagle3-curve.jsonl")
    metrics = train_loop(
        store, {"fc": drafter.fc, "step": drafter.modules[0]},
        lambda batch: eagle3_loss(drafter, batch, t2d_index, config.ttt_steps,
                                  config.step_decay),
        config, out / "eagle3-state.pt", extra, run, curve)
    save_drafter(to_device(drafter, "cpu").eval(), out / "eagle3")
    metrics["draft_vocab_coverage"] = float(counts[t2d.numpy()].sum() / max(1, counts.sum()))
    return metrics


def evaluate_eagle3(store: FeatureStore, target: TargetModel, head_dir, config,
                    device: str = "cpu") -> dict:
    """The saved head's loss and per-step accuracy over `store` (held-out features)."""
    from trt_spec.export.drafter_checkpoint import load_drafter
    from trt_spec.train.loop import evaluate

    drafter = to_device(load_drafter(head_dir, "eagle3", target), device).eval()
    t2d_index = target_to_draft(drafter.d2t, target.config.vocab_size).to(device)
    return evaluate(store, lambda batch: eagle3_loss(drafter, batch, t2d_index, config.ttt_steps,
                                                     config.step_decay),
                    config.batch_size, device)
