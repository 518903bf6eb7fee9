"""The tokenizer routes, with vLLM's names and shapes: what evaluation harnesses and clients
use to count and cut prompts with the served model's own tokenizer.

    POST /tokenize        {"prompt": str} or {"messages": [...]}, add_special_tokens,
                          add_generation_prompt, return_token_strs
                          -> {"count", "max_model_len", "tokens", "token_strs"}
    POST /detokenize      {"tokens": [int]} -> {"prompt": str}
    GET  /tokenizer_info  the tokenizer's special tokens, chat template and context
                          (lm-evaluation-harness probes it to use the server's tokenizer)
"""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter, Request
from pydantic import BaseModel

from trt_spec.runtime import validation
from trt_spec.serve.endpoint import check_model, read_request, served
from trt_spec.serve.protocol import STRICT, RequestError

router = APIRouter()


class TokenizeRequest(BaseModel):
    model_config = STRICT
    model: str | None = None
    prompt: str | None = None  # one of prompt and messages
    messages: Any = None  # chat messages, through the model's chat template
    # default: true for a prompt, false for messages (the template writes its own)
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True  # messages: the assistant's turn opened
    return_token_strs: bool = False  # each token as the vocabulary spells it


class DetokenizeRequest(BaseModel):
    model_config = STRICT
    model: str | None = None
    tokens: list[int]


@router.post("/tokenize")
async def tokenize(request: Request):
    ctx = served(request)
    req = await read_request(request, TokenizeRequest)
    if req.model is not None:
        check_model(req.model, ctx.model_name)
    if (req.prompt is None) == (req.messages is None):
        raise RequestError("give one of prompt (a string) and messages (chat messages)",
                           "prompt" if req.prompt is None else "messages")
    tokenizer = ctx.scheduler.tokenizer
    if req.prompt is not None:
        special = req.add_special_tokens is not False
        ids = (await asyncio.to_thread(tokenizer.encode_batch, [req.prompt], special))[0]
    else:
        special = bool(req.add_special_tokens)
        try:
            messages = validation.chat(req.messages)
            if tokenizer.escape_special:  # as the chat route reads them: contents plain text
                ids = await asyncio.to_thread(tokenizer.encode_chat, messages,
                                              req.add_generation_prompt)
                if special:  # what the tokenizer adds before a text (a BOS)
                    ids = tokenizer.encode("", add_special_tokens=True, escape=False) + ids
            else:
                text = await asyncio.to_thread(tokenizer.apply_chat_template, messages,
                                               req.add_generation_prompt)
                ids = (await asyncio.to_thread(tokenizer.encode_batch, [text], special,
                                               False))[0]
        except ValueError as e:  # a bad message, no chat template, or the template refused
            raise RequestError(str(e), "messages") from None
    return {"count": len(ids), "max_model_len": ctx.scheduler.max_len, "tokens": ids,
            "token_strs": [tokenizer.piece(t) for t in ids] if req.return_token_strs
            else None}


@router.post("/detokenize")
async def detokenize(request: Request):
    ctx = served(request)
    req = await read_request(request, DetokenizeRequest)
    if req.model is not None:
        check_model(req.model, ctx.model_name)
    tokenizer = ctx.scheduler.tokenizer
    vocab = tokenizer.vocab_size
    bad = [t for t in req.tokens if not 0 <= t < vocab]
    if bad:
        raise RequestError(f"tokens {bad[:4]} are outside 0..{vocab - 1}", "tokens")
    text = await asyncio.to_thread(tokenizer.decode, req.tokens, False)
    return {"prompt": text}


@router.get("/tokenizer_info")
async def tokenizer_info(request: Request):
    ctx = served(request)
    t = ctx.scheduler.tokenizer
    return {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": t.bos_token,
            "eos_token": t.eos_token, "pad_token": t.pad_token, "unk_token": t.unk_token,
            "chat_template": t.chat_template, "model_max_length": ctx.scheduler.max_len,
            "vocab_size": t.vocab_size}
