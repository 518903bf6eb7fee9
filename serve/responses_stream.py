"""A Responses API answer from the chat path's pieces: output items and the event sequence.

The chat path's Shape (serve/chat.py) turns the scheduler's Outputs into chat deltas
(reasoning_content, content, tool_calls: the thinking section split off, calls parsed);
`Builder` turns those into output items, and into the events of a streamed response:

    response.created, response.in_progress
    per item, in order                     reasoning  ->  message  ->  function_call ...
      response.output_item.added
      response.content_part.added          (reasoning_text / output_text)
      response.reasoning_text.delta ...  | response.output_text.delta ...
      response.reasoning_text.done       | response.output_text.done
      response.content_part.done
      (a function_call: response.function_call_arguments.delta, .done; its arguments in one
       delta, as the chat path parses a call once it is whole)
      response.output_item.done
    response.completed | response.incomplete (max_output_tokens) | response.failed

A whole response is the same Builder fed the whole answer as one delta, so the streamed and
whole answers hold the same items.
"""

from __future__ import annotations

import json
import time
import uuid

from trt_spec.runtime.stream import RequestMetrics
from trt_spec.runtime.tokenizer import Tokenizer


def item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


class Builder:
    """One response's output items, built from chat deltas; each call returns the events it
    makes (dicts with "type", numbered in order by sequence_number)."""

    def __init__(self, head: dict):
        """head: the response object's fields besides output, status and usage."""
        self.head = head
        self.output: list[dict] = []
        self.open: dict | None = None  # the reasoning or message item being written
        self.seq = 0

    def event(self, kind: str, **fields) -> dict:
        e = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return e

    def response(self, status: str, **more) -> dict:
        return {**self.head, "status": status, "output": self.output, **more}

    def opening(self) -> list[dict]:
        """response.created and response.in_progress."""
        shown = self.response("in_progress", usage=None)
        return [self.event("response.created", response=shown),
                self.event("response.in_progress", response=shown)]

    def feed(self, delta: dict, logprobs: list[dict]) -> list[dict]:
        """The events of one chat delta: {"reasoning_content", "content", "tool_calls"}, and
        its tokens' logprobs (chat's logprobs.content entries)."""
        out = []
        if delta.get("reasoning_content"):
            out += self.text("reasoning", delta["reasoning_content"], [])
        if delta.get("content") or (logprobs and "content" in delta):
            out += self.text("message", delta.get("content") or "", logprobs)
        for call in delta.get("tool_calls") or []:
            out += self.call(call["id"], call["function"]["name"],
                             call["function"]["arguments"])
        return out

    def text(self, kind: str, text: str, logprobs: list[dict]) -> list[dict]:
        """Text for the open item of `kind` (opened first, the one before closed)."""
        out = []
        if self.open is None or self.open["type"] != kind:
            out += self.close()
            out += self.start(kind)
        item = self.open
        part = item["content"][0]
        part["text"] += text
        at = {"item_id": item["id"], "output_index": len(self.output) - 1, "content_index": 0}
        if kind == "reasoning":
            out.append(self.event("response.reasoning_text.delta", **at, delta=text))
        else:
            part["logprobs"] += logprobs
            out.append(self.event("response.output_text.delta", **at, delta=text,
                                  logprobs=logprobs))
        return out

    def start(self, kind: str) -> list[dict]:
        """A reasoning or message item added, with its one content part."""
        if kind == "reasoning":
            item = {"id": item_id("rs"), "type": "reasoning", "summary": [], "content": [],
                    "status": "in_progress"}
            part = {"type": "reasoning_text", "text": ""}
        else:
            item = {"id": item_id("msg"), "type": "message", "role": "assistant",
                    "status": "in_progress", "content": []}
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        self.output.append(item)
        self.open = item
        added = self.event("response.output_item.added", output_index=len(self.output) - 1,
                           item=copy_of(item))
        item["content"].append(part)
        return [added, self.event("response.content_part.added", item_id=item["id"],
                                  output_index=len(self.output) - 1, content_index=0,
                                  part=copy_of(part))]

    def close(self, status: str = "completed") -> list[dict]:
        """The open item's text, part and item done."""
        item, self.open = self.open, None
        if item is None:
            return []
        item["status"] = status
        part = item["content"][0]
        at = {"item_id": item["id"], "output_index": self.output.index(item),
              "content_index": 0}
        done = (self.event("response.reasoning_text.done", **at, text=part["text"])
                if item["type"] == "reasoning" else
                self.event("response.output_text.done", **at, text=part["text"],
                           logprobs=part["logprobs"]))
        return [done, self.event("response.content_part.done", **at, part=copy_of(part)),
                self.event("response.output_item.done", output_index=at["output_index"],
                           item=copy_of(item))]

    def call(self, call_id: str, name: str, arguments: str) -> list[dict]:
        """A function_call item: added, its arguments (one delta), done."""
        out = self.close()
        item = {"id": item_id("fc"), "type": "function_call", "call_id": call_id,
                "name": name, "arguments": "", "status": "in_progress"}
        self.output.append(item)
        at = {"item_id": item["id"], "output_index": len(self.output) - 1}
        out.append(self.event("response.output_item.added", output_index=at["output_index"],
                              item=copy_of(item)))
        out.append(self.event("response.function_call_arguments.delta", **at,
                              delta=arguments))
        item.update(arguments=arguments, status="completed")
        out.append(self.event("response.function_call_arguments.done", **at, name=name,
                              arguments=arguments))
        out.append(self.event("response.output_item.done", output_index=at["output_index"],
                              item=copy_of(item)))
        return out

    def finish(self, finish_reason: str, usage: dict, more: dict) -> tuple[dict, list[dict]]:
        """(the whole response, the events that end it): an answer with no item gets an empty
        message; one cut by max_output_tokens is "incomplete", its open item too."""
        cut = finish_reason == "length"
        out = [] if self.output else self.start("message")
        out += self.close("incomplete" if cut else "completed")
        response = self.response(
            "incomplete" if cut else "completed", usage=usage,
            incomplete_details={"reason": "max_output_tokens"} if cut else None,
            completed_at=None if cut else int(time.time()), **more)
        kind = "response.incomplete" if cut else "response.completed"
        return response, out + [self.event(kind, response=response)]

    def failed(self, error: dict) -> list[dict]:
        """response.failed: error is the server's {"message", "code", ...}."""
        out = self.close("incomplete")
        response = self.response("failed", usage=None,
                                 error={"code": error.get("code"), "message": error["message"]})
        return out + [self.event("response.failed", response=response)]


def copy_of(d: dict) -> dict:
    """A snapshot of an item or part as an event shows it (later text is not added to it)."""
    return json.loads(json.dumps(d))


def usage(m: RequestMetrics, reasoning: str, tokenizer: Tokenizer) -> dict:
    """The Responses usage of one answer; reasoning_tokens: the thinking text's tokens (as
    the tokenizer spells it again)."""
    thought = len(tokenizer.encode(reasoning, add_special_tokens=False)) if reasoning else 0
    return {"input_tokens": m.prompt_tokens,
            "input_tokens_details": {"cached_tokens": m.cached_tokens},
            "output_tokens": m.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": min(thought, m.completion_tokens)},
            "total_tokens": m.prompt_tokens + m.completion_tokens}


def sse(event: dict) -> str:
    """A server-sent event as OpenAI writes them: its type as the event name."""
    return f"event: {event['type']}\ndata: {json.dumps(event, ensure_ascii=False)}\n\n"
