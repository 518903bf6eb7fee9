"""What every drafter trainer shares: padded batches from a FeatureStore, AdamW with a cosine
schedule, and a resumable loop that checkpoints every N steps.

The batch order is a function of (seed, epoch) only, so a resumed run sees the same batches
as an uninterrupted one from the step it stopped at. With a train/curve.py Curve the loop
also evaluates on held-out data every `eval_every` training tokens (the learning curve); the
tokens seen and training seconds are part of the saved state, so the curve resumes too.
"""

from __future__ import annotations

import contextlib
import math
import os
import signal
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from trt_spec.train.configs import TrainConfig
from trt_spec.train.features import FeatureStore, Sequence


# Settings that do not change the trained weights: a resumed run may change them.
RUN_ONLY = ("eval_every", "eval_sequences", "fit_schedule")  # a fitted length is saved
FIT_AFTER = 10  # steps timed before a schedule is fitted to the time left


def train_settings(config: TrainConfig) -> dict:
    """The settings a training state was written with (compared on resume)."""
    return {k: v for k, v in asdict(config).items() if k not in RUN_ONLY}


@dataclass
class Batch:
    input_ids: torch.Tensor  # [B, T] int64, right-padded with 0
    loss_mask: torch.Tensor  # [B, T] bool: x_p is an assistant token (False on padding)
    lengths: torch.Tensor  # [B] int64
    hidden: torch.Tensor  # [B, T, H] fp32
    eagle3: torch.Tensor  # [B, T, 3H] fp32
    topk_ids: torch.Tensor  # [B, T, k] int64
    topk_probs: torch.Tensor  # [B, T, k] fp32


def collate(seqs: list[Sequence], device: str | torch.device = "cpu") -> Batch:
    t = max(len(s.input_ids) for s in seqs)

    def pad(name: str, dtype) -> torch.Tensor:
        first = getattr(seqs[0], name)
        out = np.zeros((len(seqs), t, *first.shape[1:]), dtype=first.dtype)
        for i, s in enumerate(seqs):
            x = getattr(s, name)
            out[i, :len(x)] = x
        return torch.from_numpy(out).to(device=device, dtype=dtype)

    return Batch(pad("input_ids", torch.int64), pad("loss_mask", torch.bool),
                 torch.tensor([len(s.input_ids) for s in seqs], device=device),
                 pad("hidden", torch.float32), pad("eagle3", torch.float32),
                 pad("topk_ids", torch.int64), pad("topk_probs", torch.float32))


def read_batch(store, indices: list[int], device) -> Batch:
    """The sequences `indices` of a FeatureStore (cached features) or of a LiveFeatures
    (train/live.py: the target runs on them now)."""
    if hasattr(store, "batch"):
        return store.batch(indices, device)
    return collate([store[i] for i in indices], device)


def sequence_lengths(store) -> np.ndarray:
    """[N] tokens of each sequence of a FeatureStore or LiveFeatures, no features read."""
    if hasattr(store, "examples"):
        return np.array([len(ex.input_ids) for ex in store.examples], dtype=np.int64)
    return np.concatenate([np.diff(np.asarray(store.arrays(s)["offsets"], dtype=np.int64))
                           for s in store.shards])


def steps_per_epoch(n: int, batch_size: int) -> int:
    return math.ceil(n / batch_size)


def total_steps(n: int, config: TrainConfig) -> int:
    return max(1, math.ceil(config.epochs * steps_per_epoch(n, config.batch_size)))


def batch_indices(n: int, step: int, config: TrainConfig) -> list[int]:
    """The sequences of global step `step`: epoch e is a permutation seeded by (seed, e)."""
    per_epoch = steps_per_epoch(n, config.batch_size)
    epoch, i = divmod(step, per_epoch)
    order = np.random.default_rng([config.seed, epoch]).permutation(n)
    return order[i * config.batch_size:(i + 1) * config.batch_size].tolist()


def tokens_before(store, step: int, config: TrainConfig) -> int:
    """Sequence tokens the first `step` steps train on (for a state saved without them)."""
    lengths = sequence_lengths(store)
    return int(sum(lengths[batch_indices(len(lengths), s, config)].sum() for s in range(step)))


def lr_factor(step: int, total: int, config: TrainConfig) -> float:
    """Linear warm-up over min(warmup_steps, a tenth of the run), then cosine down to
    min_lr_ratio (a short run is not all warm-up)."""
    warmup = max(1, min(config.warmup_steps, total // 10))
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    cosine = 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    return config.min_lr_ratio + (1 - config.min_lr_ratio) * cosine


def autocast(device, enabled: bool):
    """bf16 autocast on `device` (cpu or cuda) when enabled: matmuls in bf16, fp32 master
    weights and optimizer (~2x on a CPU with AVX-512 BF16, more on a GPU)."""
    return torch.autocast(device_type=torch.device(device).type, dtype=torch.bfloat16,
                          enabled=enabled)


def save_state(path: Path, step: int, modules: dict[str, torch.nn.Module],
               optimizer: torch.optim.Optimizer, extra: dict, tokens_seen: int = 0,
               seconds: float = 0.0, total: int | None = None) -> None:
    """Atomic: written beside, then renamed over the previous one. tokens_seen / seconds:
    training tokens and seconds (held-out evaluations excluded) up to `step`, all runs."""
    state = {"step": step, "optimizer": optimizer.state_dict(), "extra": extra,
             "modules": {k: m.state_dict() for k, m in modules.items()},
             "tokens_seen": tokens_seen, "seconds": seconds, "total": total}
    tmp = path.with_suffix(".tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)


class Stopped(KeyboardInterrupt):
    """Ctrl-C or SIGTERM stopped a training run after its state was saved (--resume goes on)."""


@contextlib.contextmanager
def stop_requests():
    """While the loop runs, Ctrl-C and SIGTERM ask it to stop after the step in progress (its
    state is then saved) instead of killing it mid-step: yields a list that is non-empty once
    asked. A second signal stops at once. Outside the main thread (no handlers): never asked."""
    asked: list[int] = []
    if threading.current_thread() is not threading.main_thread():
        yield asked
        return

    def ask(signum, frame):
        if asked:
            raise KeyboardInterrupt
        asked.append(signum)

    before = {sig: signal.signal(sig, ask) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield asked
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)


@dataclass(frozen=True)
class StepLog:
    step: int
    total: int
    lr: float
    metrics: dict  # floats from the loss function
    tokens_per_s: float  # sequence tokens (padding excluded) per second, this run
    heldout: dict | None = None  # the learning-curve record written at this step, if any


@dataclass(frozen=True)
class RunControl:
    """How one training run runs, not what it learns (that is TrainConfig): on which device,
    whether it goes on from its saved state, where each step is logged, and when this run stops
    early. max_steps stops it after that many steps (a later resume continues), for tests and
    short runs; max_seconds likewise once that much time has passed (the state is saved at
    the stop); with TrainConfig.fit_schedule the schedule is instead shortened, after
    FIT_AFTER timed steps, to end at max_seconds (the fitted length is saved, so a resume
    keeps it)."""

    device: str = "cpu"
    resume: bool = False
    log: Callable[[StepLog], None] | None = None
    max_steps: int | None = None
    max_seconds: float | None = None


def train_loop(store: FeatureStore, modules: dict[str, torch.nn.Module],
               loss_fn: Callable[[Batch], tuple[torch.Tensor, dict]], config: TrainConfig,
               state_path: Path, extra: dict, run: RunControl = RunControl(),
               curve=None) -> dict:
    """Trains the parameters of `modules` that require grad, as `run` says. `extra`
    (JSON-able) is saved in the state and must match on resume. Returns the final metrics.
    curve: a train/curve.py Curve, evaluated at step 0, every curve.every training tokens
    and at the schedule's end."""
    device, log = run.device, run.log
    max_steps, max_seconds = run.max_steps, run.max_seconds
    params = [p for m in modules.values() for p in m.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=config.lr, weight_decay=config.weight_decay,
                                  betas=(0.9, 0.95))
    total = total_steps(len(store), config)
    step, tokens_seen, seconds = 0, 0, 0.0
    extra = dict(extra, config=train_settings(config), sequences=len(store))
    if run.resume and state_path.exists():
        state = torch.load(state_path, map_location=device, weights_only=False)
        if state["extra"] != extra:
            raise ValueError(f"{state_path} was written by another run (settings or data "
                             "differ); drop --resume or use another --out")
        for k, m in modules.items():
            m.load_state_dict(state["modules"][k])
        optimizer.load_state_dict(state["optimizer"])
        step = state["step"]
        tokens_seen = state.get("tokens_seen")
        if tokens_seen is None:  # a state saved before tokens were counted
            tokens_seen = tokens_before(store, step, config)
        seconds = state.get("seconds", 0.0)
        total = state.get("total") or total
    fitted = total != total_steps(len(store), config)  # a resumed run keeps its length
    fitting, fit_at = False, 0.0  # this run fitted it (and may shorten it again), when
    per_epoch = steps_per_epoch(len(store), config.batch_size)

    def record(lr: float, losses: list[float]) -> dict:
        return curve.record(modules, config.batch_size, device, step=step,
                            tokens_seen=tokens_seen, epoch=step / per_epoch, lr=lr,
                            train_loss=sum(losses) / len(losses) if losses else None,
                            seconds=seconds)

    if curve is not None:
        curve.restart(step)
        if step == 0:
            record(config.lr * lr_factor(0, total, config), [])
    start, tokens, metrics, losses = time.perf_counter(), 0, {}, []
    stop = total if max_steps is None else min(total, step + max_steps)
    first = step
    with stop_requests() as asked:
        while step < stop:
            t0 = time.perf_counter()
            batch = read_batch(store, batch_indices(len(store), step, config), device)
            lr = config.lr * lr_factor(step, total, config)
            for group in optimizer.param_groups:
                group["lr"] = lr
            with autocast(device, config.amp):
                loss, metrics = loss_fn(batch)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, config.grad_clip)
            optimizer.step()
            step += 1
            n = int(batch.lengths.sum())
            tokens += n
            tokens_seen += n
            seconds += time.perf_counter() - t0
            losses.append(metrics["loss"])
            heldout = None
            # the record before the state: a crash between them re-evaluates, never skips one
            if curve is not None and (curve.due(tokens_seen - n, tokens_seen) or step == total):
                heldout, losses = record(lr, losses), []
            elapsed = time.perf_counter() - start
            if (config.fit_schedule and max_seconds is not None and (fitting or not fitted)
                    and step - first >= FIT_AFTER and (step - first) % FIT_AFTER == 0
                    and step < total):
                # the cosine ends when the time does, rather than being cut off mid-way: fitted
                # after FIT_AFTER steps, then shortened again every FIT_AFTER steps from the pace
                # so far when the steps slow down (a shared machine), never lengthened
                pace = max(elapsed / (step - first), (elapsed - fit_at) / FIT_AFTER)
                total = min(total, step + max(1, int((max_seconds - elapsed) / pace)))
                stop, fitted, fitting, fit_at = min(stop, total), True, True, elapsed
            # fitted here, the schedule may overrun by a few slow steps; past half the time again
            # it stops anyway
            limit = None if max_seconds is None else max_seconds * (1.5 if fitting else 1.0)
            if limit is not None and elapsed > limit:
                stop = step
            if asked:  # Ctrl-C or SIGTERM during the step: save it, then stop
                stop = step
            if step % config.checkpoint_every == 0 or step == stop:
                save_state(state_path, step, modules, optimizer, extra, tokens_seen, seconds,
                           total)
            if log is not None:
                log(StepLog(step, total, lr, metrics, tokens / (time.perf_counter() - start),
                            heldout))
        if asked:
            raise Stopped(f"stopped at step {step} of {total}; the state is saved in "
                          f"{state_path} (--resume goes on)")
    return {"step": step, "total_steps": total, "done": step >= total, **metrics,
            "tokens_seen": tokens_seen,
            "tokens_per_s": tokens / max(time.perf_counter() - start, 1e-9)}


@torch.no_grad()
def evaluate(store: FeatureStore, loss_fn: Callable[[Batch], tuple[torch.Tensor, dict]],
             batch_size: int, device: str = "cpu", limit: int | None = None) -> dict:
    """loss_fn's metrics over every sequence of `store` (the first `limit` ones), weighted by
    assistant tokens."""
    sums, weight = {}, 0
    size = len(store) if limit is None else min(limit, len(store))
    for lo in range(0, size, batch_size):
        batch = read_batch(store, list(range(lo, min(lo + batch_size, size))), device)
        _, metrics = loss_fn(batch)
        n = int(batch.loss_mask.sum())
        weight += n
        for k, v in metrics.items():
            sums[k] = sums.get(k, 0.0) + v * n
    return {k: v / max(weight, 1) for k, v in sums.items()}
