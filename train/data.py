"""Training text: ShareGPT V3 conversations (export/sharegpt.py: the file, its records and
the held-out split) rendered with the target's chat template.

    rendering  the target's chat template over the whole conversation; the loss mask marks the
               tokens of every assistant turn (its text and its end-of-turn marker), found by
               rendering each prefix of the conversation: the template must render a prefix
               of the conversation as a prefix of the text (ChatML templates do).
    truncation the first `max_len` tokens of each conversation; one with no assistant token
               left is dropped.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from trt_spec.export.sharegpt import Conversation
from trt_spec.runtime.tokenizer import Tokenizer


@dataclass(frozen=True)
class Example:
    id: str
    input_ids: np.ndarray  # [n] int32
    loss_mask: np.ndarray  # [n] bool: an assistant token


# --- tokens and the assistant mask ------------------------------------------------------

def assistant_spans(tok: Tokenizer, messages: list[dict]) -> tuple[str, list[tuple[int, int]]]:
    """(the rendered text, [start, end) character spans of each assistant turn)."""
    text = tok.apply_chat_template(messages, add_generation_prompt=False)
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        before = tok.apply_chat_template(messages[:i], add_generation_prompt=True) if i else ""
        through = tok.apply_chat_template(messages[:i + 1], add_generation_prompt=False)
        if not (text.startswith(through) and through.startswith(before)):
            raise ValueError("the chat template does not render a conversation's prefix as a "
                             "prefix of its text; the assistant mask cannot be found")
        spans.append((len(before), len(through)))
    return text, spans


def tokenize(tok: Tokenizer, conv: Conversation, max_len: int) -> Example | None:
    """The conversation's first `max_len` tokens and their assistant mask; None when no
    assistant token is left."""
    if max_len < 2:
        raise ValueError(f"max_len {max_len}: must be at least 2")
    text, spans = assistant_spans(tok, list(conv.messages))
    ids, offsets = tok.encode_with_offsets(text)
    ids, offsets = ids[:max_len], offsets[:max_len]
    starts = np.array([o[0] for o in offsets], dtype=np.int64)
    mask = np.zeros(len(ids), dtype=bool)
    for lo, hi in spans:
        mask |= (starts >= lo) & (starts < hi)
    if not mask.any():
        return None
    return Example(conv.id, np.asarray(ids, dtype=np.int32), mask)


def tokenize_all(tok: Tokenizer, conversations: list[Conversation], max_len: int,
                 max_tokens: int | None = None) -> list[Example]:
    """Tokenized examples in order, until `max_tokens` tokens in all (the last one may pass it)."""
    out, total = [], 0
    for conv in conversations:
        if max_tokens is not None and total >= max_tokens:
            break
        ex = tokenize(tok, conv, max_len)
        if ex is not None:
            out.append(ex)
            total += len(ex.input_ids)
    return out
