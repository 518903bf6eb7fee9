"""Training MTP modules and an Eagle module by self-distillation from the target.

Both are export/drafters.py's MTPModule, reading the target's final-normed hidden state
(features `hidden`) and trained with train/unroll.py's forward against the target's top-k;
the registry's `looped` trait (runtime/methods.py) tells them apart:

    mtp    N modules, chained as the runtime runs them: module i, row p, reads x_{p+i+1}
           and module i-1's next hidden at row p (the target's for i = 0) and predicts
           x_{p+i+2}; the losses of the modules are summed (gradients flow along the chain,
           as DeepSeek-V3 trains them).
    eagle  one module looped: a training-time-test unroll of config.ttt_steps steps, each
           reading the module's own previous hidden state, weighed step_decay ** j.

A new module starts with the target's embedding and head (frozen: save_drafter leaves the
embedding out and the loader takes the target's; an untied head is saved as is) and its
final norm; eh_proj and the layer are random.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from trt_spec.export.published_heads import layer_config, target_head
from trt_spec.export.drafters import Drafter, MTPModule
from trt_spec.export.model import TargetModel
from trt_spec.runtime.methods import METHODS
from trt_spec.train.curve import CHAIN, chain_accept, make_curve
from trt_spec.train.features import FeatureStore
from trt_spec.train.loop import Batch, RunControl
from trt_spec.train.unroll import distill_loss, top1_hits, unroll

# the methods whose drafter is MTP modules over the target's hidden state (mtp, eagle)
KINDS = tuple(n for n, m in METHODS.items() if m.reads == "hidden_states")


def init_mtp(target: TargetModel, n: int, seed: int = 0, kind: str = "mtp",
             intermediate_size: int | None = None) -> Drafter:
    if kind not in KINDS:
        raise ValueError(f"kind {kind!r}: expected one of {', '.join(KINDS)}")
    if n < 1 or (METHODS[kind].looped and n != 1):
        raise ValueError(f"{n} modules: mtp needs at least 1, eagle exactly 1")
    tied = target.lm_head is None
    hf = {"intermediate_size": intermediate_size} if intermediate_size else {}
    config = dataclasses.replace(layer_config(hf, target.config), tie_word_embeddings=tied)
    torch.manual_seed(seed)
    modules = []
    for _ in range(n):
        m = MTPModule(config)
        with torch.no_grad():
            m.embed_tokens.weight.copy_(target.embed_tokens.weight)
            m.head_norm.copy_(target.norm)
            if m.lm_head is not None:
                m.lm_head.weight.copy_(target_head(target))
                m.lm_head.weight.requires_grad_(False)
        m.embed_tokens.weight.requires_grad_(False)
        modules.append(m)
    return Drafter(kind, modules)


def mtp_loss(drafter: Drafter, batch: Batch, steps: int, step_decay: float,
             chain: bool = False):
    """-> (loss, metrics loss_i / acc_i per module (mtp) or per unrolled step (eagle)).
    chain: also train/curve.py's chain acceptance accept_j of max(modules, steps) draft steps
    (mtp: past its modules the last one loops, as the runtime drafts; those steps weigh 0)."""
    vocab = drafter.config.vocab_size
    identity = torch.arange(vocab, device=batch.input_ids.device)
    total, metrics = 0.0, {}
    if METHODS[drafter.kind].looped:
        outs = unroll(drafter.modules[0], batch.input_ids, batch.hidden, steps)
        weights = [step_decay ** j for j in range(steps)]
    else:
        outs, hidden, n = [], batch.hidden, len(drafter.modules)
        for i, module in enumerate(drafter.modules):
            loops = 1 + (max(0, steps - n) if chain and i == n - 1 else 0)
            rows = unroll(module, batch.input_ids, hidden, loops, token_offset=i)
            outs += rows
            hidden = rows[0][1]
        weights = [1.0] * n + [0.0] * (len(outs) - n)
    hits = []
    for j, ((logits, _), w) in enumerate(zip(outs, weights)):
        loss_j, acc_j = distill_loss(logits, batch, j, identity, identity)
        total = total + w * loss_j
        metrics[f"loss_{j}"] = float(loss_j.detach())
        metrics[f"acc_{j}"] = acc_j
        if chain:
            hits.append(top1_hits(logits, batch, j, identity))
    metrics["loss"] = float(total.detach())
    if chain:
        metrics.update(chain_accept(hits))
    return total, metrics


def fine_tuned_mtp(folder, target: TargetModel, kind: str) -> Drafter:
    """Saved modules to train further (--init-from): the target's embedding (and an untied
    head) stay frozen, every other weight trains."""
    from trt_spec.export.drafter_checkpoint import load_drafter

    drafter = load_drafter(folder, kind, target)
    for m in drafter.modules:
        m.float().train()
        for name, p in m.named_parameters():
            p.requires_grad_(not name.startswith(("embed_tokens", "lm_head")))
    return drafter


def train_mtp(store: FeatureStore, target: TargetModel, out, config, kind: str = "mtp",
              num_modules: int = 3, run: RunControl = RunControl(),
              intermediate_size: int | None = None, heldout=None, init=None) -> dict:
    """As train_eagle3: state `out/<kind>-state.pt`, the drafter `out/<kind>/`, the learning
    curve `out/<kind>-curve.jsonl`. init: saved modules to start from (their number and
    width), else fresh ones."""
    from trt_spec.export.drafter_checkpoint import save_drafter
    from trt_spec.train.loop import train_loop

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    drafter = (fine_tuned_mtp(init, target, kind) if init is not None else
               init_mtp(target, 1 if METHODS[kind].looped else num_modules, config.seed,
                        kind, intermediate_size))
    for m in drafter.modules:
        m.to(run.device)
    extra = {"kind": kind, "plan": store.manifest["plan"], "shards": store.shards,
             "modules": len(drafter.modules),
             "intermediate_size": drafter.config.intermediate_size,
             "init": str(init) if init is not None else None}
    curve = make_curve(config, heldout, lambda batch: mtp_loss(
        drafter, batch, max(config.ttt_steps, CHAIN), config.step_decay, chain=True),
        out / f"{kind}-curve.jsonl")
    metrics = train_loop(
        store, {f"module_{i}": m for i, m in enumerate(drafter.modules)},
        lambda batch: mtp_loss(drafter, batch, config.ttt_steps, config.step_decay),
        config, out / f"{kind}-state.pt", extra, run, curve)
    for m in drafter.modules:
        m.to("cpu").eval()
    save_drafter(drafter, out / kind)
    return metrics


def evaluate_mtp(store: FeatureStore, target: TargetModel, head_dir, config, kind: str = "mtp",
                 device: str = "cpu") -> dict:
    """The saved modules' loss and accuracy per module (mtp) or step (eagle) over `store`."""
    from trt_spec.export.drafter_checkpoint import load_drafter
    from trt_spec.train.loop import evaluate

    drafter = load_drafter(head_dir, kind, target)
    for m in drafter.modules:
        m.to(device).eval()
    return evaluate(store, lambda batch: mtp_loss(drafter, batch, config.ttt_steps,
                                                  config.step_decay),
                    config.batch_size, device)
