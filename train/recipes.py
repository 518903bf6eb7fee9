"""What `trt-spec train` runs for each method it trains, by the method's train name
(runtime/methods.py TRAIN_NAMES; the table is checked against it at import): the check of the
run's settings against the target, the training, and the evaluation of a saved drafter.

    RECIPES["eagle3"].check(config, target.config)                  # ValueError: a bad setting
    RECIPES["mtp"].train(config, "mtp", store, target, run, heldout, init)      -> metrics
    RECIPES["draft"].evaluate(config, "draft", store, target, OUT / "draft")    -> metrics

MTP and Eagle share one trainer (train/mtp.py), which reads the registry's `looped` trait.
The trainers are imported when called: this table loads no torch module.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from trt_spec.runtime.config import ModelConfig
from trt_spec.runtime.methods import TRAIN_NAMES


def no_check(config, target: ModelConfig) -> None:
    pass


def check_draft_vocab(config, target: ModelConfig) -> None:
    """Eagle3's draft vocabulary fits in the target's."""
    if not 1 <= config.draft_vocab <= target.vocab_size:
        raise ValueError(f"draft vocabulary size {config.draft_vocab}: must be in "
                         f"1..{target.vocab_size} (the target's vocabulary)")


def check_draft_layers(config, target: ModelConfig) -> None:
    """The vanilla draft's layers are the target's."""
    bad = [i for i in config.draft_layers if not 0 <= i < target.num_layers]
    if not config.draft_layers or bad:
        raise ValueError(f"--draft-layers {list(config.draft_layers)}: each must be in "
                         f"0..{target.num_layers - 1}")


# (config, method, store, target, run, heldout, init) -> metrics; config: train/configs.py
# RunConfig, run: train/loop.py RunControl, init: a drafter folder to fine-tune, or None

def train_eagle3(config, method, store, target, run, heldout, init) -> dict:
    from trt_spec.train.eagle3 import train_eagle3

    return train_eagle3(store, target, config.out, config.train, config.draft_vocab, run,
                        config.head_intermediate, heldout, init)


def train_modules(config, method, store, target, run, heldout, init) -> dict:
    from trt_spec.train.mtp import train_mtp

    return train_mtp(store, target, config.out, config.train, method, config.num_modules, run,
                     config.head_intermediate, heldout, init)


def train_draft(config, method, store, target, run, heldout, init) -> dict:
    from trt_spec.train.draft import train_draft

    return train_draft(store, target, config.out, config.train, config.draft_layers, run,
                       heldout, init)


# (config, method, store, target, head_dir) -> metrics of the drafter saved in head_dir

def evaluate_eagle3(config, method, store, target, head_dir) -> dict:
    from trt_spec.train.eagle3 import evaluate_eagle3

    return evaluate_eagle3(store, target, head_dir, config.train, config.device)


def evaluate_modules(config, method, store, target, head_dir) -> dict:
    from trt_spec.train.mtp import evaluate_mtp

    return evaluate_mtp(store, target, head_dir, config.train, method, config.device)


def evaluate_draft(config, method, store, target, head_dir) -> dict:
    from trt_spec.train.draft import evaluate_draft

    return evaluate_draft(store, target, head_dir, config.train, config.device)


@dataclass(frozen=True)
class Recipe:
    train: Callable[..., dict]
    evaluate: Callable[..., dict]
    check: Callable[..., None] = no_check  # the run's settings for it, before any stage


RECIPES = {
    "eagle3": Recipe(train_eagle3, evaluate_eagle3, check_draft_vocab),
    "mtp": Recipe(train_modules, evaluate_modules),
    "eagle": Recipe(train_modules, evaluate_modules),
    "draft": Recipe(train_draft, evaluate_draft, check_draft_layers),
}
assert set(RECIPES) == set(TRAIN_NAMES), (sorted(RECIPES), TRAIN_NAMES)


def check_settings(config, target: ModelConfig) -> None:
    """Each method's settings against the target, in training order (TRAIN_NAMES)."""
    for method in TRAIN_NAMES:
        if method in config.methods:
            RECIPES[method].check(config, target)
