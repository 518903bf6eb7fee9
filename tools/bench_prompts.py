"""`trt-spec bench`'s prompt files: JSONL, {"prompt": ...} or {"messages": [...]} per line, and
optionally "json_schema": {...}, the structure its answer is held to."""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path


def default_prompts_path() -> Path:
    return Path(str(resources.files("trt_spec.runtime") / "data" / "prompts.jsonl"))


def load_prompts(path: str | Path | None) -> list:
    """FILE.jsonl: one object per line, {"prompt": "..."} or {"messages": [...]} (and maybe a
    "json_schema": load_schemas)."""
    return [p for p, _ in read_prompts(path)]


def load_schemas(path: str | Path | None) -> list[dict | None]:
    """Per prompt of FILE.jsonl, the JSON schema its line gives its answer ("json_schema"), or
    None."""
    return [schema for _, schema in read_prompts(path)]


def read_prompts(path: str | Path | None) -> list[tuple]:
    path = Path(path) if path else default_prompts_path()
    if not path.is_file():
        raise ValueError(f"--prompts {str(path)!r}: no such file")
    prompts = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{n}: not JSON ({e})") from e
        schema = obj.get("json_schema") if isinstance(obj, dict) else None
        if schema is not None and not isinstance(schema, dict):
            raise ValueError(f"{path}:{n}: json_schema must be a JSON object")
        if isinstance(obj, dict) and isinstance(obj.get("prompt"), str):
            prompts.append((obj["prompt"], schema))
        elif isinstance(obj, dict) and isinstance(obj.get("messages"), list):
            prompts.append((obj["messages"], schema))
        else:
            raise ValueError(f'{path}:{n}: expected {{"prompt": "..."}} or {{"messages": [...]}}')
    if not prompts:
        raise ValueError(f"{path}: no prompts")
    return prompts


PROMPTS = load_prompts(None)  # the default prompts, as plain strings
