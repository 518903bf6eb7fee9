"""Features computed as training reads them: the target runs on each batch, nothing is cached.

On a GPU the target's forward costs less than reading cached fp16 features back from disk (a
token's features take ~4.8 kB), so `--features live` trains on the same rows as a FeatureStore
without writing them: hidden states, Eagle3 features and the target's top-k probabilities of
the batch's sequences, from train/forward.py's causal forward. It offers what the trainers
read from a FeatureStore (len, batch, token_counts, feature_layers, manifest["plan"], shards).
"""

from __future__ import annotations

import hashlib

import numpy as np
import torch

from trt_spec.export.model import TargetModel
from trt_spec.train.data import Example
from trt_spec.train.forward import causal_forward
from trt_spec.train.loop import Batch


def plan(source: str, examples: list[Example]) -> str:
    """What a store computed on the fly trains on (the trainer checks it on resume): where its
    features come from and its examples' ids and tokens, hashed."""
    h = hashlib.sha256(source.encode())
    for ex in examples:
        h.update(ex.id.encode())
        h.update(ex.input_ids.tobytes())
    return h.hexdigest()


class LiveFeatures:
    def __init__(self, target: TargetModel, examples: list[Example], top_k: int, device: str,
                 model_id: str = ""):
        if not examples:
            raise ValueError("no examples to train on")
        self.target = target.to(device).eval()
        self.examples = examples
        self.top_k = top_k
        self.device = device
        self.manifest = {"plan": plan(f"live {model_id} {top_k}", examples)}
        self.shards: list[str] = []

    @property
    def feature_layers(self) -> tuple[int, ...]:
        return tuple(self.target.config.eagle3_layers)

    def __len__(self) -> int:
        return len(self.examples)

    @property
    def tokens(self) -> int:
        return sum(len(ex.input_ids) for ex in self.examples)

    def token_counts(self, vocab_size: int) -> np.ndarray:
        counts = np.zeros(vocab_size, dtype=np.int64)
        for ex in self.examples:
            counts += np.bincount(ex.input_ids, minlength=vocab_size)[:vocab_size]
        return counts

    @torch.no_grad()
    def batch(self, indices: list[int], device=None) -> Batch:
        exs = [self.examples[i] for i in indices]
        t = max(len(ex.input_ids) for ex in exs)
        ids = np.zeros((len(exs), t), dtype=np.int64)
        mask = np.zeros((len(exs), t), dtype=bool)
        for i, ex in enumerate(exs):
            ids[i, :len(ex.input_ids)] = ex.input_ids
            mask[i, :len(ex.loss_mask)] = ex.loss_mask
        input_ids = torch.from_numpy(ids).to(self.device)
        hidden, eagle3 = causal_forward(self.target, input_ids, want_features=True)
        top_ids, top_probs = [], []
        for row in range(len(exs)):  # one sequence at a time: [T, vocab] logits, not [B, T, vocab]
            probs = self.target.head(hidden[row]).float().softmax(-1)
            p, i = probs.topk(self.top_k, dim=-1)
            top_probs.append(p)
            top_ids.append(i)
        lengths = torch.tensor([len(ex.input_ids) for ex in exs], device=self.device)
        real = (torch.arange(t, device=self.device)[None] < lengths[:, None])[..., None]
        # Rounded through fp16 and zero on padding, like collated cached features, so both
        # paths train on the same values.
        return Batch(input_ids, torch.from_numpy(mask).to(self.device), lengths,
                     (hidden * real).half().float(), (eagle3 * real).half().float(),
                     torch.stack(top_ids) * real, (torch.stack(top_probs) * real).half().float())
