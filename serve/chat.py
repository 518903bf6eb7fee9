"""POST /v1/chat/completions: chat messages through the model's chat template, as OpenAI's
chat completions API; max_completion_tokens or max_tokens, logprobs with top_logprobs, and
tool calling (tools, tool_choice, parallel_tool_calls: runtime/tool_calls.py), and vLLM's
prompt_logprobs (the templated prompt's tokens, in the response beside choices),
chat_template_kwargs and reasoning_content (a thinking section apart from the answer:
runtime/reasoning.py)."""

from __future__ import annotations

import asyncio
import dataclasses

from fastapi import APIRouter, Request

from trt_spec.runtime import reasoning
from trt_spec.runtime.chat import PLAIN, Chat, Reading
from trt_spec.runtime.sampling import TokenLogprob
from trt_spec.runtime.scheduler import Output
from trt_spec.runtime.scheduler import Request as Job
from trt_spec.runtime.tokenizer import Tokenizer
from trt_spec.runtime.validation import FieldError
from trt_spec.serve.endpoint import (Prompted, Served, answer, check_model, check_size,
                                     read_request, served)
from trt_spec.serve.protocol import ChatRequest, RequestError, chat_messages, \
    sampling_params, structure_param, truncated
from trt_spec.serve.streaming import Shape, prompt_logprobs, token_piece

router = APIRouter()


@router.post("/v1/chat/completions")
async def chat_completions(request: Request):
    req = await read_request(request, ChatRequest)
    return await answer(request, req, [await chat_prompt(served(request), req)])


async def chat_prompt(ctx: Served, req: ChatRequest) -> Prompted:
    """The chat's one prompt: its messages templated and tokenized, its sampling params (held
    to the tool-call grammar, after the thinking section: runtime/chat.py), how its answer
    reads (a Shape). POST /v1/responses (serve/responses.py) answers through it too."""
    scheduler, tokenizer = ctx.scheduler, ctx.scheduler.tokenizer
    check_model(req.model, ctx.model_name)
    messages = chat_messages(req)
    check_size(scheduler, [m["content"] for m in messages], "messages")
    chat = named_field(Chat.of, tokenizer, req.tools, req.tool_choice,
                       req.parallel_tool_calls is not False, req.chat_template_kwargs,
                       reasoning_effort=req.reasoning_effort,
                       add_generation_prompt=req.add_generation_prompt,
                       continue_final_message=req.continue_final_message,
                       documents=req.documents)
    try:  # the template and the tokenizer, off the event loop
        ids = await asyncio.to_thread(chat.encode, messages)
    except ValueError as e:  # no chat template, or the template refused the messages
        raise RequestError(str(e), "messages") from None
    ids = truncated(ids, req, scheduler.max_len)
    max_tokens = req.max_completion_tokens if req.max_tokens is None else req.max_tokens
    params = sampling_params(req, max_tokens, max(scheduler.max_len - len(ids), 1), tokenizer)
    params, reading = named_field(chat.hold, ids, params, structure_param(req))
    if ctx.reasoning_in_content:  # the thinking section stays in the content
        reading = dataclasses.replace(reading, think=None)
    shape = (ToolChatShape if reading.tools else ChatShape)(
        tokenizer, params.logprobs is not None, reading)
    shape.with_reasoning = req.include_reasoning is not False
    shape.echo = echoed(req, messages)
    return Prompted(ids, params, shape)


def named_field(run, *args, **kwargs):
    """run(*args, **kwargs), its FieldError a 400 naming the request's field."""
    try:
        return run(*args, **kwargs)
    except FieldError as e:
        raise RequestError(str(e), e.field) from None


def echoed(req: ChatRequest, messages: list[dict]) -> str:
    """vLLM's echo: the last message's content, where it is the assistant's (the role the
    answer has), goes in front of the answer's content."""
    last = messages[-1]
    return last["content"] if req.echo and last["role"] == "assistant" else ""


class ChatShape(Shape):
    object = "chat.completion"
    chunk_object = "chat.completion.chunk"
    id_prefix = "chatcmpl"
    prompt_param = "messages"
    splitter: reasoning.Splitter | None = None  # this choice's, made on its first delta
    with_reasoning: bool = True  # include_reasoning: false leaves the reasoning out
    echo: str = ""  # vLLM's echo: the last (assistant) message, in front of the content

    def __init__(self, tokenizer: Tokenizer, logprobs: bool, reading: Reading = PLAIN,
                 index: int = 0):
        """reading: how the answer reads (runtime/chat.py): the calls it may make, where its
        thinking section starts (think None: not split, also under --reasoning-in-content)."""
        super().__init__(tokenizer, logprobs, index)
        self.reading = reading

    def opening(self) -> dict:
        return {"index": self.index, "delta": {"role": "assistant", "content": self.echo},
                "logprobs": None, "finish_reason": None}

    def pieces(self, out: Output) -> tuple[str, str]:
        """(new reasoning, new content) of a delta: the thinking section apart, its tags
        held back until they are whole."""
        if self.reading.think is None:
            return "", out.text
        if self.splitter is None:
            self.splitter = reasoning.Splitter(self.reading.think)
        thought, text = self.splitter.feed(out.text, out.finish_reason is not None)
        return (thought if self.with_reasoning else ""), text

    def delta(self, job: Job, out: Output) -> dict:
        thought, text = self.pieces(out)
        lp = self.content_logprobs(out.logprobs)
        return {"index": self.index, "delta": delta_of(thought, text, out.logprobs),
                "logprobs": lp, "finish_reason": out.finish_reason}

    def whole(self, job: Job) -> dict:
        """The finished answer's message: its reasoning, content and calls (Reading.read)."""
        s = job.stream
        thought, content, calls = self.reading.read(s.text)
        thought = thought if self.with_reasoning else None
        content = self.echo + (content or "") if self.echo else content
        more = {"tool_calls": [c.to_dict() for c in calls]} if calls else {}
        finish = calls_finish(s.finish_reason) if calls else s.finish_reason
        return {"index": self.index, "message": self.message(thought, content, **more),
                "logprobs": self.content_logprobs(s.logprobs), "finish_reason": finish}

    def message(self, thought: str | None, content: str | None, **more) -> dict:
        """The answer's message; reasoning_content where the template thinks (vLLM's)."""
        thinking = {} if self.reading.think is None else {"reasoning_content": thought}
        return {"role": "assistant", "content": content, **thinking, **more}

    def response_fields(self, job: Job) -> dict:
        """vLLM's prompt_logprobs of the templated prompt, when asked for."""
        if job.stream.params.prompt_logprobs is None:
            return {}
        return {"prompt_logprobs": prompt_logprobs(self.tokenizer, job.stream.prompt_logprobs)}

    def content_logprobs(self, logprobs: list[TokenLogprob]) -> dict | None:
        return chat_logprobs(self.tokenizer, logprobs) if self.with_logprobs else None


class ToolChatShape(ChatShape):
    """A chat answer that may call tools: text streams as content until a call opens; from
    there it is held, and parsed when the answer ends into `tool_calls` (finish_reason
    "tool_calls"), or handed back as content where it does not parse."""

    text, sent = "", 0  # the answer so far; how much of it went out as content

    def delta(self, job: Job, out: Output) -> dict:
        thought, text = self.pieces(out)
        self.text += text
        lp = self.content_logprobs(out.logprobs)
        if out.finish_reason is None:
            end = self.reading.fmt.held_from(self.text, self.sent)
            text, self.sent = self.text[self.sent:end], max(self.sent, end)
            return {"index": self.index, "delta": delta_of(thought, text, out.logprobs),
                    "logprobs": lp, "finish_reason": None}
        r = self.reading
        content, calls = r.fmt.parse(self.text, r.tools, r.held)
        if not calls:  # no call, or one that does not parse: the rest is content
            rest, self.sent = self.text[self.sent:], len(self.text)
            return {"index": self.index, "delta": delta_of(thought, rest, out.logprobs),
                    "logprobs": lp, "finish_reason": out.finish_reason}
        delta = {**delta_of(thought, "", []),
                 "tool_calls": [c.to_dict(i) for i, c in enumerate(calls)]}
        return {"index": self.index, "delta": delta, "logprobs": lp,
                "finish_reason": calls_finish(out.finish_reason)}


def delta_of(thought: str, text: str, logprobs: list) -> dict:
    """A chunk's delta: the new reasoning_content and content (content also where only
    logprobs are new), or {} where there is nothing."""
    delta = {"reasoning_content": thought} if thought else {}
    if text or (logprobs and not thought):
        delta["content"] = text
    return delta


def calls_finish(finish_reason: str) -> str:
    """An answer of calls finishes with "tool_calls", or "length" where max_tokens cut it."""
    return "length" if finish_reason == "length" else "tool_calls"


def chat_logprobs(tokenizer: Tokenizer, logprobs: list[TokenLogprob]) -> dict:
    """OpenAI's chat `logprobs`: {"content": [{token, logprob, bytes, top_logprobs}]}."""
    def entry(token_id: int, logprob: float) -> dict:
        text, raw = token_piece(tokenizer, token_id)
        return {"token": text, "logprob": logprob, "bytes": raw}

    return {"content": [{**entry(lp.token_id, lp.logprob),
                         "top_logprobs": [entry(t, v) for t, v in lp.top]}
                        for lp in logprobs], "refusal": None}
