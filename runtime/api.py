"""The Python API: `from trt_spec import LLM, SamplingParams` (names after vLLM's).

    llm = LLM("engines/smollm2-135m", method="ngram", num_draft_tokens=4)
    outputs = llm.generate(["Why is the sky blue?"], SamplingParams(max_tokens=64))
    for delta in llm.stream("Name three rivers."):
        print(delta, end="")

`LLM` drives the same Scheduler as `trt-spec serve`, from the calling thread: prompts are
batched continuously up to `max_num_seqs` KV slots.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

from trt_spec.runtime.chat import Chat
from trt_spec.runtime.generator import Generator, Prompt
from trt_spec.runtime.methods import PLAIN, Speculation
from trt_spec.runtime.provenance import TokenSource
from trt_spec.runtime.sampling import SamplingParams, TokenLogprob
from trt_spec.runtime.scheduler import Output, Request, Scheduler
from trt_spec.runtime.settings import BACKENDS, SERVE_MAX_BATCH, RuntimeConfig, SpeculationConfig
from trt_spec.runtime.stream import RequestMetrics
from trt_spec.runtime.tool_calls import ToolCall


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None  # "stop" | "length"
    # per token when SamplingParams.logprobs is set: its log-probability under the target
    # and the most likely alternatives (TokenLogprob); None otherwise
    logprobs: list[TokenLogprob] | None = None
    # LLM.chat with tools: the calls parsed from the text (runtime/tool_calls.py); None: none
    tool_calls: list[ToolCall] | None = None
    # LLM.chat on a template with a thinking section (runtime/reasoning.py): the text
    # between <think> and </think>; None where the answer did not think. `text` stays whole.
    reasoning_content: str | None = None
    # per token (as token_ids), where it came from: an accepted draft and its drafter, the
    # grammar, or the target (runtime/provenance.py)
    token_sources: list[TokenSource] = field(default_factory=list)


@dataclass
class StreamDelta:
    """What `LLM.stream(..., details=True)` yields: the new text (as plain `stream` yields
    it) and the new tokens with their origins."""

    text: str
    token_ids: list[int]
    token_sources: list[TokenSource]
    finish_reason: str | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: Prompt
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]  # SamplingParams.n of them, by index
    finished: bool
    # method, k, tau, acceptance per position, timings (seconds): the first output's
    metrics: RequestMetrics
    # when SamplingParams.prompt_logprobs is set, as vLLM's: per prompt token, None for the
    # first, then its TokenLogprob (log-probability given the tokens before it, rank, and the
    # most likely alternatives); None otherwise
    prompt_logprobs: list[TokenLogprob | None] | None = None
    # the seed the request was sampled with (its own, or one drawn at admission when it gave
    # none): the same request with this seed gives these outputs again, under any method
    # and k (choice i draws with seed + i)
    seed: int | None = None

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason

    @property
    def logprobs(self) -> list[TokenLogprob] | None:
        return self.outputs[0].logprobs


def check_backend(backend: str) -> str:
    """'auto' picks ONNX Runtime (the engine folder's graphs); else one of the BACKENDS."""
    if backend != "auto" and backend not in BACKENDS:
        raise ValueError(f"backend={backend!r}: expected auto or one of {', '.join(BACKENDS)}")
    return "ort" if backend == "auto" else backend


def as_prompt_list(prompts: Prompt | list[Prompt]) -> list[Prompt]:
    """A string, one chat (a list of message dicts), or a list of either."""
    if isinstance(prompts, str):
        return [prompts]
    if isinstance(prompts, list) and prompts and all(isinstance(m, dict) for m in prompts):
        return [prompts]  # one chat (checked when encoded: runtime/validation.py)
    if isinstance(prompts, (list, tuple)):
        return list(prompts)
    raise ValueError(f"prompts {prompts!r}: expected a string, a chat (list of "
                     "{'role', 'content'} dicts) or a list of these")


def check_params(params) -> SamplingParams:
    if not isinstance(params, SamplingParams):
        raise ValueError(f"sampling_params={str(params)[:80]}: expected a SamplingParams "
                         f"(got {type(params).__name__}; SamplingParams(**d) makes one "
                         "from a dict)")
    return params


class LLM:
    def __init__(self, model: str | Path, method: str = PLAIN,
                 num_draft_tokens: int | str = SpeculationConfig.num_draft_tokens,
                 backend: str = "auto", max_num_seqs: int = SERVE_MAX_BATCH,
                 max_model_len: int = RuntimeConfig.max_len, **options):
        """model: an engine folder (`trt-spec export`). method: none, ngram, or a drafter the
        folder has (see `methods`); num_draft_tokens: its k. backend: "auto" / "ort",
        "torch-cuda" or "trt". max_num_seqs: KV slots (streams batched together);
        max_model_len: context per stream. options: any other RuntimeConfig setting
        (runtime/settings.py), flat, by its field name or the CLI's: threads, device,
        cuda_graphs, exact_decode, max_prefill_tokens, speculation=SpeculationConfig(...) or
        its fields (spec_max_batch, spec_min_acceptance, ngram_min, ...); spec_fallback (or
        fallback): the policy's gain rules (a step drafts fewer tokens, or none, where that
        is measured to be faster; False: every step drafts its k; default on)."""
        config = RuntimeConfig.from_options(
            method=method, num_draft_tokens=num_draft_tokens, backend=check_backend(backend),
            max_num_seqs=max_num_seqs, max_model_len=max_model_len, **options)
        self.config = config
        self.backend = config.backend
        self.generator = Generator(model, config)
        self.scheduler = Scheduler(self.generator)

    @property
    def methods(self) -> list[str]:
        """The methods this engine folder can run."""
        return list(self.scheduler.methods)

    @property
    def tokenizer(self):
        return self.generator.tokenizer

    def _submit(self, prompts: list[Prompt], params: SamplingParams, spec: Speculation, chat,
                on_output=None) -> list[Request]:
        check_params(params)
        if chat is not None and not isinstance(chat, bool):
            raise ValueError(f"chat={chat!r}: expected True, False or None (the model's "
                             "default)")
        if not prompts:
            raise ValueError("prompts is empty: expected a string, a chat or a list of these")
        ids = [self.scheduler.encode(p, chat) for p in prompts]
        return self._enqueue(ids, [params] * len(ids), spec, on_output)

    def _enqueue(self, ids: list[list[int]], params: list[SamplingParams], spec: Speculation,
                 on_output=None) -> list[Request]:
        # every prompt is checked (Scheduler.prepare: a FieldError) before any is queued
        requests = [self.scheduler.prepare(p, q, spec, on_output)
                    for p, q in zip(ids, params)]
        return self.scheduler.enqueue_all(requests)

    def _cancel(self, requests: list[Request]) -> None:
        left = [r for r in requests if not all(c.done for c in r.choices)]
        for r in left:
            self.scheduler.cancel(r.id)  # every choice of it
        if left:
            self.scheduler.step()  # applies the cancellations: frees the KV slots

    def generate(self, prompts: Prompt | list[Prompt], sampling_params: SamplingParams | None
                 = None, *, method: str | None = None, num_draft_tokens: int | str | None = None,
                 chat: bool | None = None) -> list[RequestOutput]:
        """Runs every prompt to completion; outputs in prompt order, each with
        SamplingParams.n completions (the prompt read once). Plain strings go through the chat
        template when the model has one (chat=False: raw text)."""
        prompts = as_prompt_list(prompts)
        params = sampling_params or SamplingParams()
        requests = self._submit(prompts, params, Speculation(method, num_draft_tokens), chat)
        return self._run(requests, prompts)

    def _run(self, requests: list[Request], prompts: list[Prompt]) -> list[RequestOutput]:
        """Steps the scheduler until every request is done; outputs in request order."""
        try:
            while not all(c.done for r in requests for c in r.choices):
                self.scheduler.step()
        finally:
            self._cancel(requests)
        for c in (c for r in requests for c in r.choices):
            if c.error:
                raise RuntimeError(f"request {c.id} failed: {c.error}")
        return [self._output(r, p) for r, p in zip(requests, prompts)]

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | None = None, *, tools: list[dict] | None = None,
             tool_choice: str | dict | None = None, parallel_tool_calls: bool = True,
             method: str | None = None, num_draft_tokens: int | str | None = None,
             chat_template_kwargs: dict | None = None) -> list[RequestOutput]:
        """One chat (a list of messages) or a list of chats, run to completion. tools:
        OpenAI's function tools, shown to the model in its template's format; tool_choice
        (none, auto, required or {"type": "function", "function": {"name"}}) as OpenAI's:
        required or a named function holds the output to a grammar of the allowed calls. Each
        output's `tool_calls` holds the calls parsed from its text (runtime/tool_calls.py).
        chat_template_kwargs: more of the template's variables (e.g. {"enable_thinking":
        False}); a template with a thinking section (runtime/reasoning.py) gives each output
        its `reasoning_content`, and a structure (a JSON schema, regex, grammar or choices in
        sampling_params, or the call grammar) holds the output only after the thinking
        section, also where the template opened it in the prompt."""
        chats = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        if not chats:
            raise ValueError("messages is empty: expected a chat (a list of messages) or a "
                             "list of chats")
        chat = Chat.of(self.tokenizer, tools, tool_choice, parallel_tool_calls,
                       chat_template_kwargs)
        params = check_params(sampling_params or SamplingParams())
        ids = [chat.encode(c) for c in chats]
        held = [chat.hold(i, params) for i in ids]  # per chat: (its params, its Reading)
        requests = self._enqueue(ids, [p for p, _ in held], Speculation(method, num_draft_tokens))
        outputs = self._run(requests, chats)
        for out, (_, reading) in zip(outputs, held):
            for c in out.outputs:
                c.reasoning_content, _, c.tool_calls = reading.read(c.text)
        return outputs

    def stream(self, prompt: Prompt, sampling_params: SamplingParams | None = None, *,
               method: str | None = None, num_draft_tokens: int | str | None = None,
               chat: bool | None = None, details: bool = False
               ) -> Iterator[str] | Iterator[StreamDelta]:
        """Yields the text as it is generated, in deltas (whole characters, never past a stop
        string); their concatenation is `generate`'s text. details: yields StreamDelta
        instead (the text and the new tokens with their origins, runtime/provenance.py),
        one per step that added text or tokens, the last with its finish_reason. Breaking
        out frees the slot. One completion: n > 1 is `generate`'s."""
        params = sampling_params or SamplingParams()
        if params.n != 1:
            raise ValueError(f"n={params.n}: stream() yields one completion's text; "
                             "generate() returns n")
        pending: deque[Output] = deque()
        request = self._submit([prompt], params, Speculation(method, num_draft_tokens), chat,
                               pending.append)[0]
        try:
            while True:
                while pending:
                    out = pending.popleft()
                    if details and (out.text or out.token_ids or out.finished):
                        yield StreamDelta(out.text, out.token_ids, out.sources,
                                          out.finish_reason)
                    elif not details and out.text:
                        yield out.text
                    if out.finished:
                        if request.error:
                            raise RuntimeError(f"request {request.id} failed: {request.error}")
                        return
                self.scheduler.step()
        finally:
            self._cancel([request])

    @staticmethod
    def _output(r: Request, prompt: Prompt) -> RequestOutput:
        s = r.stream
        outputs = [CompletionOutput(c.index, c.stream.text, list(c.stream.output_ids),
                                    c.stream.finish_reason, list(c.stream.logprobs)
                                    if c.stream.params.logprobs is not None else None,
                                    token_sources=list(c.stream.sources))
                   for c in r.choices]
        return RequestOutput(r.id, prompt, s.prompt_ids, outputs,
                             all(c.stream.finished for c in r.choices), s.metrics(),
                             list(s.prompt_logprobs) if s.params.prompt_logprobs is not None
                             else None, s.params.seed)
