"""Which replica a request belongs on, by the prompt it starts with: a chat's later turns go
where its earlier turns left their KV rows (each replica's prefix cache is its own).

    route_key(path, body)   the request's opening, hashed: the same for every turn of a chat
    rank(key, replicas)     replicas in the key's order of preference (rendezvous hashing)

A chat's key is its tools, its leading system messages and its first user message: every
later turn of the chat resends them first, unchanged, so every turn has the key of the first.
A Responses request (stateless: each turn resends the conversation) is keyed alike, by its
tools, instructions and input up to its first user message.
A completions prompt's key is its first OPENING_CHARS characters (OPENING_IDS ids for a
token-id prompt), so prompts that extend one another (a client continuing its own text) and
prompts that share a long few-shot preamble meet on one replica. Other routes have no key.

Rendezvous (highest random weight) hashing needs no shared state: every router ranks a key's
replicas the same way, and a replica that leaves moves only its own keys. Ray-free: the Ray
Serve router (serve/ray_routing.py) calls it.
"""

from __future__ import annotations

import hashlib
import json

OPENING_CHARS = 512  # of a completions prompt
OPENING_IDS = 128  # of a token-id prompt
KEYED_ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/responses")


def _digest(data: str) -> str:
    return hashlib.blake2b(data.encode("utf-8", "surrogatepass"), digest_size=16).hexdigest()


def chat_opening(body: dict) -> list | None:
    """The tools, leading system/developer messages and first user message, as sent."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        return None
    opening = []
    for m in messages:
        opening.append(m)
        if isinstance(m, dict) and m.get("role") == "user":
            break
    return [body.get("tools"), opening]


def responses_opening(body: dict) -> list | None:
    """The tools, instructions and input up to its first user message (a string input is
    one), as sent."""
    items = body.get("input")
    if isinstance(items, list):
        items = chat_opening({"messages": items})
        items = items and items[1]
    if not items:
        return None
    return [body.get("tools"), body.get("instructions"), items]


def completion_opening(body: dict) -> object | None:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and not all(isinstance(t, int) for t in prompt):
        prompt = prompt[0]  # a list of prompts goes where its first one belongs
    if isinstance(prompt, str):
        return prompt[:OPENING_CHARS]
    if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
        return prompt[:OPENING_IDS]
    return None


def route_key(path: str, body: bytes) -> str | None:
    """The request's key, or None (another route, or a body that is not a JSON object: the
    replica that gets it answers with the error)."""
    if path.rstrip("/") not in KEYED_ROUTES:
        return None
    try:  # (JSON nested past Python's recursion limit: the replica refuses it, with a 400)
        data = json.loads(body)
        if not isinstance(data, dict):
            return None
        route = path.rstrip("/")
        opening = (chat_opening(data) if route.endswith("chat/completions") else
                   responses_opening(data) if route.endswith("responses") else
                   completion_opening(data))
        if opening is None:
            return None
        return _digest(json.dumps(opening, sort_keys=True, ensure_ascii=False, default=str))
    except (ValueError, UnicodeDecodeError, RecursionError):
        return None


def rank(key: str, replicas: list[str]) -> list[str]:
    """`replicas` (ids) from the key's first choice to its last."""
    return sorted(replicas, key=lambda r: _digest(f"{key}\0{r}"), reverse=True)
