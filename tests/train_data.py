"""Tiny ShareGPT-layout conversations in the tiny tokenizer's words (no download)."""

from __future__ import annotations

import json
import random
from pathlib import Path

WORDS = [chr(c) for c in range(ord("a"), ord("z") + 1)] + [f"w{i}" for i in range(60)]


def sharegpt_records(n: int, seed: int = 0, turns: int = 2) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        conv = []
        for t in range(turns):
            user = " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 8)))
            # assistant answers follow a pattern a head can partly learn
            start = rng.randrange(len(WORDS))
            answer = " ".join(WORDS[(start + 3 * j) % len(WORDS)] for j in range(rng.randint(6, 14)))
            conv += [{"from": "human", "value": user}, {"from": "gpt", "value": answer}]
        out.append({"id": f"c{i // 2}_{i % 2}", "conversations": conv})
    return out


def write_sharegpt(path: Path, records: list[dict], cut_tail: bool = False) -> Path:
    """cut_tail: end the file inside one more record, as the packaged ShareGPT file does."""
    text = json.dumps(records, indent=1)
    if cut_tail:
        extra = json.dumps({"id": "cut_0", "conversations": [{"from": "human", "value": "a b"}]})
        text = text[:-1].rstrip() + ",\n" + extra[:len(extra) // 2]
    Path(path).write_text(text)
    return Path(path)
