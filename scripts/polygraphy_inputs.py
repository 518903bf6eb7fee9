"""Feeds for polygraphy's ORT-vs-TRT parity runs (`--data-loader-script`), valid for the graph
contract: a verify step of T new tokens after a past of P per row, random cache contents.

    TRT_SPEC_ENGINE=engines/NAME polygraphy run engines/NAME/target.onnx --onnxrt \
        --data-loader-script scripts/polygraphy_inputs.py:load_data --save-outputs ort.json ...

Environment: TRT_SPEC_ENGINE (the engine folder), TRT_SPEC_GRAPH (default "target"),
TRT_SPEC_MAX_LEN (64), TRT_SPEC_BATCH (2), TRT_SPEC_NEW_TOKENS (5), TRT_SPEC_PAST (7).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

SIZES = {"max_len": 64, "batch": 2, "new_tokens": 5, "past": 7}


def feeds(graph: dict, max_len: int, batch: int, new_tokens: int, past: int,
          seed: int = 0) -> dict[str, np.ndarray]:
    """One step's inputs for a manifest graph entry (target, draft or drafter step)."""
    assert past + new_tokens <= max_len, (past, new_tokens, max_len)
    rng = np.random.default_rng(seed)
    sizes = {"batch": batch, "new_tokens": new_tokens, "num_logits": new_tokens,
             "max_len": max_len}
    out = {}
    for spec in graph["inputs"]:
        shape = tuple(sizes[d] if isinstance(d, str) else d for d in spec["shape"])
        name = spec["name"]
        if name == "input_ids":
            vocab = 100  # any ids below the smallest vocabulary used in practice
            out[name] = rng.integers(0, vocab, shape, dtype=np.int64)
        elif name == "position_ids":
            out[name] = np.tile(np.arange(past, past + new_tokens), (batch, 1)).astype(np.int64)
        elif name == "seqlens_k":
            out[name] = np.full(shape, past + new_tokens - 1, dtype=np.int32)
        elif name == "query_seqlens":
            out[name] = np.full(shape, new_tokens, dtype=np.int32)
        elif name == "total_sequence_length":
            out[name] = np.array(past + new_tokens, dtype=np.int32)
        elif name == "logits_index":
            out[name] = np.tile(np.arange(new_tokens), (batch, 1)).astype(np.int64)
        else:  # hidden states, features, KV cache
            out[name] = rng.standard_normal(shape).astype(spec["dtype"])
    return out


def load_data():
    folder = Path(os.environ["TRT_SPEC_ENGINE"])
    manifest = json.loads((folder / "manifest.json").read_text())
    graph = manifest["graphs"][os.environ.get("TRT_SPEC_GRAPH", "target")]
    sizes = {k: int(os.environ.get(f"TRT_SPEC_{k.upper()}", v)) for k, v in SIZES.items()}
    yield feeds(graph, **sizes)
