"""POST /v1/completions: prompts (text, or token ids) continued, as OpenAI's legacy
completions API: n choices per prompt (prompt-major), `logprobs` the number of alternatives per token,
`echo` the prompt before the completion. With echo and logprobs every prompt token has its
log-probability too (null for the first), from the prefill's own logits: what evaluation
harnesses (lm-evaluation-harness's local-completions) score loglikelihoods with, at
max_tokens 0 or 1."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Request

from trt_spec.runtime.sampling import TokenLogprob
from trt_spec.runtime.scheduler import Output
from trt_spec.runtime.scheduler import Request as Job
from trt_spec.runtime.tokenizer import Tokenizer
from trt_spec.serve.endpoint import (Prompted, answer, check_model, check_size, read_request,
                                     served)
from trt_spec.serve.protocol import (CompletionRequest, RequestError, completion_prompts,
                                     sampling_params, truncated)
from trt_spec.serve.streaming import Shape, prompt_logprobs, token_piece

DEFAULT_MAX_TOKENS = 16  # as OpenAI's /v1/completions (chat: the rest of the context)

router = APIRouter()


@router.post("/v1/completions")
async def completions(request: Request):
    ctx = served(request)
    scheduler = ctx.scheduler
    req = await read_request(request, CompletionRequest)
    check_model(req.model, ctx.model_name)
    prompts = completion_prompts(req)
    bound, n = scheduler.max_waiting, req.n if isinstance(req.n, int) and req.n > 1 else 1
    if bound is not None and n <= bound < len(prompts) * n:  # n past it: a 400 naming n
        each = "" if n == 1 else f" of {n} choices each"
        raise RequestError(f"prompt holds {len(prompts)} prompts{each}; this server queues at "
                           f"most {bound} requests (--max-waiting), so at most {bound // n} "
                           "per request", "prompt")
    texts = [p for p in prompts if isinstance(p, str)]
    for text in texts:
        check_size(scheduler, [text], "prompt")
    # the texts tokenized together, off the event loop (encode_batch releases the GIL)
    special = req.add_special_tokens is not False  # vLLM's: a BOS where the model has one
    encoded = iter(await asyncio.to_thread(scheduler.tokenizer.encode_batch, texts, special)
                   if texts else [])
    choices = []
    for i, p in enumerate(prompts):
        ids = next(encoded) if isinstance(p, str) else p
        cut = truncated(ids, req, scheduler.max_len)  # vLLM's truncate_prompt_tokens
        p, ids = (p if cut is ids else cut), cut
        default = min(DEFAULT_MAX_TOKENS, scheduler.max_len - len(ids))
        params = sampling_params(req, req.max_tokens, max(default, 1), scheduler.tokenizer)
        echo = None if not req.echo else p  # token ids: decoded once checked (prepare)
        shape = CompletionShape(scheduler.tokenizer, params.logprobs, i, echo,
                                req.prompt_logprobs is not None)
        choices.append(Prompted(ids, params, shape))
    return await answer(request, req, choices)


class CompletionShape(Shape):
    object = chunk_object = "text_completion"
    id_prefix = "cmpl"
    prompt_param = "prompt"

    def __init__(self, tokenizer: Tokenizer, logprobs: int | None, index: int,
                 echo: str | list[int] | None, with_prompt_logprobs: bool):
        """logprobs: alternatives per token (None: no logprobs); echo: the prompt when the
        request echoes it (its text, or its token ids: decoded when first shown, after
        Scheduler.prepare found them in the vocabulary); with_prompt_logprobs: vLLM's
        prompt_logprobs asked for."""
        super().__init__(tokenizer, logprobs is not None, index)
        self.top = logprobs or 0
        self.echo = echo
        self.with_prompt_logprobs = with_prompt_logprobs
        self.offset = 0  # text_offset of the next streamed token
        self.started = False  # a chunk of this choice was streamed (the echo goes first)

    def wants_chunk(self, out: Output) -> bool:
        return super().wants_chunk(out) or (self.echo is not None and not self.started)

    def prompt_copies(self, params) -> int:
        """Each choice shows them: in its prompt_logprobs, and again in its logprobs when it
        echoes the prompt with logprobs."""
        echoed = self.echo is not None and self.with_logprobs
        return params.n * (int(echoed) + int(self.with_prompt_logprobs))

    def bulky(self) -> bool:
        """The first chunk carries the prompt's logprobs (echo with logprobs, or
        prompt_logprobs)."""
        return not self.started and ((self.echo is not None and self.with_logprobs)
                                     or self.with_prompt_logprobs)

    def delta(self, job: Job, out: Output) -> dict:
        first, self.started = not self.started, True
        return self.choice(job, out.text, out.logprobs, out.finish_reason, first)

    def whole(self, job: Job) -> dict:
        s = job.stream
        return self.choice(job, s.text, s.logprobs, s.finish_reason, True)

    def choice(self, job: Job, text: str, logprobs: list[TokenLogprob],
               finish_reason: str | None, first: bool) -> dict:
        """A choice's text and logprobs; `first`: its first piece (the echo leads it)."""
        s = job.stream
        echo = self.echo is not None and first
        lp = None
        if self.with_logprobs:
            ids, lps = [t.token_id for t in logprobs], list(logprobs)
            if echo:  # the prompt's tokens first: the first has no log-probability
                ids, lps = s.prompt_ids + ids, s.prompt_logprobs + lps
            lp = completion_logprobs(self.tokenizer, ids, lps, self.offset, self.top)
            self.offset += sum(len(t) for t in lp["tokens"])
        out = {"index": self.index, "text": (self.echo_text() if echo else "") + (text or ""),
               "logprobs": lp, "finish_reason": finish_reason}
        if self.with_prompt_logprobs and first:
            out["prompt_logprobs"] = prompt_logprobs(self.tokenizer, s.prompt_logprobs)
        return out

    def echo_text(self) -> str:
        """The echoed prompt's text (token ids decoded the first time)."""
        if not isinstance(self.echo, str):
            self.echo = self.tokenizer.decode(self.echo, skip_special_tokens=False)
        return self.echo


def completion_logprobs(tokenizer: Tokenizer, ids: list[int],
                        logprobs: list[TokenLogprob | None], offset: int, top: int) -> dict:
    """OpenAI's completions `logprobs`: tokens, token_logprobs, top_logprobs (the `top` most
    likely, by text), text_offset; a token without a log-probability (an echoed prompt's
    first) has null for both."""
    tokens = [token_piece(tokenizer, t)[0] for t in ids]
    offsets = []
    for t in tokens:
        offsets.append(offset)
        offset += len(t)
    return {"tokens": tokens,
            "token_logprobs": [None if lp is None else lp.logprob for lp in logprobs],
            "top_logprobs": [None if lp is None else
                             {token_piece(tokenizer, t)[0]: v for t, v in lp.top[:top]}
                             for lp in logprobs],
            "text_offset": offsets}
