"""POST /v1/responses: OpenAI's Responses API, stateless, translated onto the chat path.

    read      the body as a ResponsesRequest (serve/responses_protocol.py)
    translate onto a chat completions request (chat_request), which does the work: the
              template, tools, the call grammar, the thinking section (chat.chat_prompt)
    queue     as chat does (endpoint.queued)
    answer    the chat Shape's deltas as output items (responses_stream.Builder): one
              response object, or the Responses event sequence (stream: true)

So greedy output is the chat endpoint's, token for token. Errors are the server's JSON,
naming the Responses field (Names: input[2], text.format, max_output_tokens, ...).
Extensions as on chat: `speculative` in, `metrics` and `seed` out, `token_sources` (the
output's tokens and their origins, beside `output`).
"""

from __future__ import annotations

import time

from fastapi import APIRouter, Request
from fastapi.responses import Response

from trt_spec.serve.chat import chat_prompt
from trt_spec.serve.endpoint import Served, queued, read_request, served
from trt_spec.serve.protocol import ChatRequest, RequestError, structure_param
from trt_spec.serve.responses_protocol import ResponsesRequest, chat_request
from trt_spec.serve.responses_stream import Builder, sse, usage
from trt_spec.serve.streaming import (Choice, EventStream, Outputs, cancel, dumps, failure,
                                      finished, request_seed, response_metrics)

router = APIRouter()


@router.post("/v1/responses")
async def create_response(request: Request):
    ctx = served(request)
    req = await read_request(request, ResponsesRequest)
    chat, names = chat_request(req)
    try:
        prompt = await chat_prompt(ctx, chat)
        rid, (c,), outputs = await queued(ctx, chat, [prompt])
    except RequestError as e:
        raise names.error(e) from None
    structure = names.path(structure_param(chat))
    builder = Builder(head(req, ctx, chat, c, f"resp_{rid.split('-', 1)[1]}"))
    if req.stream:
        return EventStream(events(builder, c, outputs, structure),
                           lambda: cancel(ctx.scheduler, [c.job]))
    try:
        await finished(request, ctx.scheduler, [c.job], outputs, structure)
    except RequestError as e:
        raise names.error(e) from None
    whole = c.shape.whole(c.job)  # the chat choice: {"message", "logprobs", "finish_reason"}
    delta = {k: v for k, v in whole["message"].items() if v is not None}  # as one chat delta
    builder.feed(delta, token_logprobs(whole["logprobs"]))
    response, _ = builder.finish(whole["finish_reason"], *ending(builder, c))
    return Response(dumps(response).encode("utf-8"), media_type="application/json")


async def events(builder: Builder, c: Choice, outputs: Outputs, structure: str):
    """The Responses event sequence (responses_stream.py) from the choice's Outputs: each
    chat delta's items; an abort or error ends it with response.failed (`failure`)."""
    for e in builder.opening():
        yield sse(e)
    while True:
        out = await outputs.get()
        if out.finished and out.finish_reason in ("abort", "error"):
            for e in builder.failed(failure(c.job, structure).body()["error"]):
                yield sse(e)
            return
        if not out.finished and not c.shape.wants_chunk(out):
            continue
        d = c.shape.delta(c.job, out)
        for e in builder.feed(d["delta"], token_logprobs(d["logprobs"])):
            yield sse(e)
        if out.finished:
            for e in builder.finish(d["finish_reason"], *ending(builder, c))[1]:
                yield sse(e)
            return


def token_logprobs(logprobs: dict | None) -> list[dict]:
    """Chat's logprobs ({"content": [...]}) -> output_text's list (the same entries)."""
    return (logprobs or {}).get("content") or []


def ending(builder: Builder, c: Choice) -> tuple[dict, dict]:
    """(usage, this server's fields) of a finished answer: metrics, seed, token_sources."""
    s = c.job.stream
    thought = "".join(i["content"][0]["text"] for i in builder.output
                      if i["type"] == "reasoning")
    more = {"metrics": response_metrics(s.metrics()), "seed": request_seed(c.job)}
    if c.shape.sources is not None:
        more["token_sources"] = c.shape.sources.entries(s.output_ids, s.sources, final=True)
    return usage(s.metrics(), thought, c.shape.tokenizer), more


def head(req: ResponsesRequest, ctx: Served, chat: ChatRequest, c: Choice, rid: str) -> dict:
    """The response object's fields that echo the request (with the defaults it got)."""
    params = c.job.stream.params
    tools = req.tools or []
    return {"id": rid, "object": "response", "created_at": int(time.time()),
            "model": ctx.model_name, "error": None, "incomplete_details": None,
            "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
            "parallel_tool_calls": req.parallel_tool_calls is not False,
            "previous_response_id": None, "reasoning": req.reasoning, "store": False,
            "temperature": params.temperature, "top_p": params.top_p,
            "top_logprobs": chat.top_logprobs,
            "text": {"format": {"type": "text"}, **(req.text or {})},
            "tool_choice": req.tool_choice or ("auto" if tools else "none"), "tools": tools,
            "truncation": "disabled", "metadata": req.metadata or {}, "user": req.user}
