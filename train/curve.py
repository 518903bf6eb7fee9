"""The learning curve: held-out accuracy and an estimated τ against training tokens seen,
appended to OUT/<method>-curve.jsonl while a drafter trains (train/loop.py calls Curve).

Vocabulary. A propose from anchor a drafts d_1 .. d_k (draft step j = 0 .. k-1 drafts
d_{j+1}); greedy verification accepts d_1 .. d_m while each is the target's argmax, then adds
the target's own token, so a target forward yields m + 1 tokens and τ = E[m] + 1.

What the trainers' acc_j is. Training-time test feeds step j the drafter's own hidden states
of steps 0 .. j-1 but the *text's* tokens x_{a+1} .. x_{a+j+1}, and acc_j counts every anchor
whose step-j token is an assistant token, whether or not steps 0 .. j-1 were right. So acc_j
is a marginal, P(step j right), not P(step j right | steps 0 .. j-1 right); 1 + a_0 +
a_0 a_1 + ... from those marginals assumes misses are independent across steps, which they
are not (a hard position is hard at every step).

What the curve measures instead. When d_1 .. d_j are all right they *are* the text's tokens,
so step j's inputs under teacher forcing are exactly the ones it gets at inference. The chain
acceptance accept_j = P(steps 0 .. j all right) = a_0 a_1' .. a_j' (a' conditional) is then
counted directly, per anchor, over the anchors with k assistant tokens ahead, and

    tau_est = 1 + accept_0 + accept_1 + ... + accept_{k-1}        (k = CHAIN = 4)

It is an estimate, not the bench's τ: (1) "right" means the target's argmax; the chain
follows the held-out *text*, so it is exact only where the text is the target's own greedy
answer (--answers target, greedy) and otherwise leans on text the target would not have
written; (2) greedy verification only (sampling accepts with min(1, p/q)); (3) every anchor
drafts the full k (the runtime's policy may draft fewer), the anchors are those of the first
`sequences` held-out conversations, and batches are averaged weighted by assistant tokens, as
acc_j is; (4) the training weights in fp32, not the engine's precision. `trt-spec bench`
measures the real τ.

Record (one JSON line): step, tokens_seen, epoch (fractional), lr, train_loss (the mean
training loss since the previous record, or since the resume; None at step 0),
acc [per draft step], accept [per draft step], k, tau_est, seconds (training, evaluations
excluded, all runs).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from trt_spec.train.loop import Batch, evaluate

CHAIN = 4  # drafts per propose the estimate is for (k)


def chain_accept(hits: list[tuple[torch.Tensor, torch.Tensor]]) -> dict[str, float]:
    """Per draft step j, (hit [B, T] bool, valid [B, T] bool) at anchor rows (unroll.top1_hits)
    -> accept_j: the fraction of anchors valid at every step whose steps 0 .. j all hit."""
    anchors = torch.stack([valid for _, valid in hits]).all(0)  # (B, T)
    prefix = torch.stack([hit for hit, _ in hits]).long().cumprod(0).bool()  # (steps, B, T)
    n = anchors.sum().clamp(min=1)
    return {f"accept_{j}": float((prefix[j] & anchors).sum() / n) for j in range(len(hits))}


def tau_estimate(accept: list[float], k: int = CHAIN) -> float:
    """1 + accept_0 + .. + accept_{k-1}: expected tokens per target forward of a k-draft
    chain from its chain acceptances (see the module docstring; the first k are used)."""
    assert all(0 <= a <= 1 for a in accept), accept
    return 1.0 + sum(accept[:k])


def by_step(metrics: dict, name: str) -> list[float]:
    """{name}_0, {name}_1, ... of `metrics` as a list."""
    out = []
    while f"{name}_{len(out)}" in metrics:
        out.append(metrics[f"{name}_{len(out)}"])
    return out


@dataclass(frozen=True)
class Curve:
    store: object  # held-out FeatureStore or LiveFeatures
    loss_fn: Callable[[Batch], tuple[torch.Tensor, dict]]  # acc_j and accept_j per draft step
    path: Path  # OUT/<method>-curve.jsonl
    every: int  # training tokens between records
    sequences: int  # held-out sequences evaluated (the first ones)

    def due(self, before: int, after: int) -> bool:
        """Whether the tokens seen crossed a multiple of `every` going from before to after."""
        return after // self.every > before // self.every

    def restart(self, step: int) -> None:
        """A run starting at `step` keeps the records up to it (none when it starts fresh):
        the ones after it were written past the last saved state and are evaluated again."""
        kept = [r for r in read_curve(self.path) if step and r["step"] <= step]
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in kept))
        os.replace(tmp, self.path)

    def record(self, modules: dict[str, torch.nn.Module], batch_size: int, device,
               **fields) -> dict:
        """Evaluates `modules` on the held-out store and appends the record (see the module
        docstring) with `fields` (step, tokens_seen, epoch, lr, train_loss, seconds)."""
        modes = {k: m.training for k, m in modules.items()}
        for m in modules.values():
            m.eval()
        try:
            metrics = evaluate(self.store, self.loss_fn, batch_size, device, self.sequences)
        finally:
            for k, m in modules.items():
                m.train(modes[k])
        accept = by_step(metrics, "accept")
        record = dict(fields, acc=by_step(metrics, "acc"), accept=accept,
                      k=min(CHAIN, len(accept)), tau_est=tau_estimate(accept))
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
            f.flush()
            os.fsync(f.fileno())
        return record


def read_curve(path: Path) -> list[dict]:
    """The records of a curve file ([] if none). A torn last line (a crash mid-write) is
    dropped; a bad line before it is an error."""
    path = Path(path)
    if not path.exists():
        return []
    lines = path.read_text().splitlines()
    records = []
    for i, line in enumerate(lines):
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            if i < len(lines) - 1:
                raise ValueError(f"{path}: line {i + 1} is not JSON: {line[:80]!r}") from None
    return records


def make_curve(config, heldout, loss_fn, path: Path) -> Curve | None:
    """The Curve of a TrainConfig (None when config.eval_every is 0 or there is no held-out
    store)."""
    if not config.eval_every or heldout is None:
        return None
    return Curve(heldout, loss_fn, Path(path), config.eval_every, config.eval_sequences)
