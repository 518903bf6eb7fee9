"""A small vanilla draft model for a target, distilled from it.

The draft is export/model.py's TargetModel with a few layers: its decoder layers start as
copies of target layers (`layers`, the first ones by default: a layer-truncated self-draft is
where it starts), its final norm as the target's, and it shares the target's embedding and
head, frozen (the checkpoint leaves them out; the loader takes the target's, so a 2-layer
draft of SmolLM2 ships in 14 MB instead of 71). Training reads the same features as the heads:
row p's logits are trained against the target's top-k distribution of the token after x_p
(soft cross entropy over assistant tokens), with teacher forcing (a vanilla draft drafts
autoregressively from committed tokens; nothing to unroll).

Checkpoint: export/drafter_checkpoint.py's save_draft / load_draft (the project's own drafter
format, kind "draft").
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from trt_spec.export.drafter_checkpoint import load_draft, save_draft
from trt_spec.export.model import TargetModel
from trt_spec.train.curve import CHAIN, chain_accept, make_curve
from trt_spec.train.forward import causal_forward
from trt_spec.train.loop import Batch, RunControl
from trt_spec.train.unroll import distill_loss, shift, top1_hits

SHARED = ("embed_tokens.weight", "lm_head.weight")  # the target's: frozen, never saved


def init_draft(target: TargetModel, layers: tuple[int, ...]) -> TargetModel:
    t = target.config
    bad = [i for i in layers if not 0 <= i < t.num_layers]
    if not layers or bad:
        raise ValueError(f"draft layers {list(layers)}: need at least one, each in "
                         f"0..{t.num_layers - 1}")
    config = dataclasses.replace(t, num_layers=len(layers), eagle3_layers=())
    draft = TargetModel(config)
    state = {k: v.detach().clone() for k, v in target.state_dict().items()
             if not k.startswith("layers.")}
    for j, i in enumerate(layers):
        for k, v in target.layers[i].state_dict().items():
            state[f"layers.{j}.{k}"] = v.detach().clone()
    draft.load_state_dict(state)
    for name in SHARED:
        param = dict(draft.named_parameters()).get(name)
        if param is not None:
            param.requires_grad_(False)
    return draft


def draft_loss(draft: TargetModel, batch: Batch, chain: int = 0) -> tuple[torch.Tensor, dict]:
    """chain > 0: also train/curve.py's chain acceptance of `chain` draft steps. Row p drafts
    the token after x_p; with the drafts right so far, draft step j from anchor p is row p + j
    (teacher forcing reads the same tokens), so its hits are row p's shifted by j."""
    hidden, _ = causal_forward(draft, batch.input_ids)
    identity = torch.arange(draft.config.vocab_size, device=batch.input_ids.device)
    logits = draft.head(hidden)
    loss, acc = distill_loss(logits, batch, -1, identity, identity)
    metrics = {"loss": float(loss.detach()), "loss_0": float(loss.detach()), "acc_0": acc}
    if chain:
        hit, valid = top1_hits(logits, batch, -1, identity)
        metrics.update(chain_accept([(shift(hit, j), shift(valid, j)) for j in range(chain)]))
    return loss, metrics


def fine_tuned_draft(folder, target: TargetModel) -> tuple[TargetModel, tuple[int, ...]]:
    """A saved draft to train further (--init-from), and the target layers it started from."""
    import json

    draft = load_draft(folder, target).float().train()
    for name, p in draft.named_parameters():
        p.requires_grad_(name not in SHARED)
    meta = json.loads((Path(folder) / "drafter.json").read_text())
    return draft, tuple(meta.get("source_layers", ()))


def train_draft(store, target: TargetModel, out, config, layers: tuple[int, ...],
                run: RunControl = RunControl(), heldout=None, init=None) -> dict:
    """As train_eagle3: state `out/draft-state.pt`, the draft `out/draft/`, the learning curve
    `out/draft-curve.jsonl`. init: a saved draft to start from (its layers), else copies of
    the target's `layers`."""
    from trt_spec.train.loop import train_loop

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    if init is not None:
        draft, layers = fine_tuned_draft(init, target)
        draft = draft.to(run.device)
    else:
        draft = init_draft(target, layers).to(run.device)
    extra = {"kind": "draft", "plan": store.manifest["plan"], "shards": store.shards,
             "layers": list(layers)}
    curve = make_curve(config, heldout, lambda batch: draft_loss(draft, batch, CHAIN),
                       out / "draft-curve.jsonl")
    metrics = train_loop(store, {"draft": draft}, lambda batch: draft_loss(draft, batch), config,
                         out / "draft-state.pt", extra, run, curve)
    save_draft(draft.to("cpu").eval(), out / "draft", layers)
    return metrics


def evaluate_draft(store, target: TargetModel, folder, config, device: str = "cpu") -> dict:
    from trt_spec.train.loop import evaluate

    draft = load_draft(folder, target).to(device)
    return evaluate(store, lambda batch: draft_loss(draft, batch), config.batch_size, device)
