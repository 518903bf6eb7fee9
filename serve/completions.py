"""POST /v1/completions: a prompt (text, or token ids) continued, as OpenAI's legacy
completions API; `logprobs` is the number of alternatives per token."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Request

from trt_spec.runtime.sampling import TokenLogprob
from trt_spec.runtime.tokenizer import Tokenizer
from trt_spec.serve.endpoint import answer, check_model, check_size, read_body, served
from trt_spec.serve.protocol import CompletionRequest, completion_prompt, parse_body, \
    sampling_params
from trt_spec.serve.streaming import Shape, token_piece

DEFAULT_MAX_TOKENS = 16  # as OpenAI's /v1/completions (chat: the rest of the context)

router = APIRouter()


@router.post("/v1/completions")
async def completions(request: Request):
    ctx = served(request)
    scheduler = ctx.scheduler
    req = parse_body(await read_body(request), CompletionRequest)
    check_model(req.model, ctx.model_name)
    prompt = completion_prompt(req)
    if isinstance(prompt, list):
        ids = prompt
    else:
        check_size(scheduler, [prompt], "prompt")
        ids = await asyncio.to_thread(scheduler.encode, prompt, False)  # off the event loop
    default = min(DEFAULT_MAX_TOKENS, scheduler.max_len - len(ids))
    params = sampling_params(req, req.max_tokens, max(default, 1))
    shape = CompletionShape(scheduler.tokenizer, params.logprobs is not None)
    return await answer(request, req, ids, params, shape)


class CompletionShape(Shape):
    object = chunk_object = "text_completion"
    id_prefix = "cmpl"
    prompt_param = "prompt"

    def __init__(self, tokenizer: Tokenizer, logprobs: bool):
        super().__init__(tokenizer, logprobs)
        self.offsets: dict[int, int] = {}  # per choice, text_offset of its next streamed token

    def delta(self, index: int, text: str, logprobs: list[TokenLogprob],
              finish_reason: str | None) -> dict:
        lp = None
        if self.with_logprobs:
            offset = self.offsets.get(index, 0)
            lp = completion_logprobs(self.tokenizer, logprobs, offset)
            self.offsets[index] = offset + sum(len(t) for t in lp["tokens"])
        return {"index": index, "text": text or "", "logprobs": lp,
                "finish_reason": finish_reason}

    def whole(self, index: int, text: str, logprobs: list[TokenLogprob],
              finish_reason: str) -> dict:
        lp = completion_logprobs(self.tokenizer, logprobs, 0) if self.with_logprobs else None
        return {"index": index, "text": text, "logprobs": lp, "finish_reason": finish_reason}


def completion_logprobs(tokenizer: Tokenizer, logprobs: list[TokenLogprob], offset: int) -> dict:
    """OpenAI's completions `logprobs`: tokens, token_logprobs, top_logprobs, text_offset."""
    tokens = [token_piece(tokenizer, lp.token_id)[0] for lp in logprobs]
    offsets = []
    for t in tokens:
        offsets.append(offset)
        offset += len(t)
    return {"tokens": tokens, "token_logprobs": [lp.logprob for lp in logprobs],
            "top_logprobs": [{token_piece(tokenizer, t)[0]: v for t, v in lp.top}
                             for lp in logprobs],
            "text_offset": offsets}
