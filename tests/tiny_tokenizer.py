"""A word-level tokenizer for tiny test models (no download, deterministic)."""

from __future__ import annotations

import json
from pathlib import Path

SPECIALS = ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|> {{ m['role'] }} {{ m['content'] }} <|im_end|> "
    "{% endfor %}{% if add_generation_prompt %}<|im_start|> assistant {% endif %}"
)

# Qwen3's shape: the model thinks between <think> and </think>; enable_thinking=false closes
# an empty think block in the prompt
THINKING_TEMPLATE = (
    "{% for m in messages %}<|im_start|> {{ m['role'] }} {{ m['content'] }} <|im_end|> "
    "{% endfor %}{% if add_generation_prompt %}<|im_start|> assistant "
    "{% if enable_thinking is defined and enable_thinking is false %}<think> </think> "
    # as templates that open the think block in the prompt (the output starts inside it)
    "{% elif open_thinking is defined and open_thinking %}<think> "
    "{% endif %}{% endif %}"
)


def save_tiny_tokenizer(folder: Path, vocab_size: int, thinking: bool = False) -> None:
    """thinking: a Qwen3-style template, and <think> and </think> as (non-special) words."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = ["user", "assistant", "system"] + [chr(c) for c in range(ord("a"), ord("z") + 1)]
    words += ["<think>", "</think>"] if thinking else []
    words += [f"w{i}" for i in range(vocab_size - len(SPECIALS) - len(words))]
    vocab = {w: i for i, w in enumerate(SPECIALS + words)}
    assert len(vocab) == vocab_size
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(SPECIALS)
    tok.save(str(Path(folder) / "tokenizer.json"))
    (Path(folder) / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
        "chat_template": THINKING_TEMPLATE if thinking else CHAT_TEMPLATE,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }))
