"""POST /v1/chat/completions: chat messages through the model's chat template, as OpenAI's
chat completions API; max_completion_tokens or max_tokens, logprobs with top_logprobs."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Request

from trt_spec.runtime.sampling import TokenLogprob
from trt_spec.runtime.tokenizer import Tokenizer
from trt_spec.serve.endpoint import answer, check_model, check_size, read_body, served
from trt_spec.serve.protocol import ChatRequest, RequestError, chat_messages, parse_body, \
    sampling_params
from trt_spec.serve.streaming import Shape, token_piece

router = APIRouter()


@router.post("/v1/chat/completions")
async def chat_completions(request: Request):
    ctx = served(request)
    scheduler = ctx.scheduler
    req = parse_body(await read_body(request), ChatRequest)
    check_model(req.model, ctx.model_name)
    messages = chat_messages(req)
    check_size(scheduler, [m["content"] for m in messages], "messages")
    try:  # the template and the tokenizer, off the event loop
        ids = await asyncio.to_thread(scheduler.encode, messages)
    except ValueError as e:  # no chat template, or the template refused the messages
        raise RequestError(str(e), "messages") from None
    max_tokens = req.max_completion_tokens if req.max_tokens is None else req.max_tokens
    params = sampling_params(req, max_tokens, max(scheduler.max_len - len(ids), 1))
    shape = ChatShape(scheduler.tokenizer, params.logprobs is not None)
    return await answer(request, req, ids, params, shape)


class ChatShape(Shape):
    object = "chat.completion"
    chunk_object = "chat.completion.chunk"
    id_prefix = "chatcmpl"
    prompt_param = "messages"

    def opening(self, index: int) -> dict:
        return {"index": index, "delta": {"role": "assistant", "content": ""},
                "logprobs": None, "finish_reason": None}

    def delta(self, index: int, text: str, logprobs: list[TokenLogprob],
              finish_reason: str | None) -> dict:
        return {"index": index, "delta": {"content": text} if text or logprobs else {},
                "logprobs": self.content_logprobs(logprobs), "finish_reason": finish_reason}

    def whole(self, index: int, text: str, logprobs: list[TokenLogprob],
              finish_reason: str) -> dict:
        return {"index": index, "message": {"role": "assistant", "content": text},
                "logprobs": self.content_logprobs(logprobs), "finish_reason": finish_reason}

    def content_logprobs(self, logprobs: list[TokenLogprob]) -> dict | None:
        return chat_logprobs(self.tokenizer, logprobs) if self.with_logprobs else None


def chat_logprobs(tokenizer: Tokenizer, logprobs: list[TokenLogprob]) -> dict:
    """OpenAI's chat `logprobs`: {"content": [{token, logprob, bytes, top_logprobs}]}."""
    def entry(token_id: int, logprob: float) -> dict:
        text, raw = token_piece(tokenizer, token_id)
        return {"token": text, "logprob": logprob, "bytes": raw}

    return {"content": [{**entry(lp.token_id, lp.logprob),
                         "top_logprobs": [entry(t, v) for t, v in lp.top]}
                        for lp in logprobs], "refusal": None}
