"""`trt-spec generate`: one prompt through one engine folder, and how the answer is shown.

The KV cache is sized for this one request: ONNX Runtime's attention touches the whole bound
cache buffer on its first step, so an unused 2048-row cache costs RSS (SmolLM2: ~90 MB at 2048
rows; NOTES in the README).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from trt_spec.runtime.sampling import SamplingParams
from trt_spec.runtime.settings import RuntimeConfig
from trt_spec.runtime.stream import RequestMetrics

MAX_LEN = 2048  # the most KV-cache rows one request gets
ROWS = 64  # the cache is sized in whole blocks of this many rows


@dataclass(frozen=True)
class Answer:
    text: str
    token_ids: list[int]
    finish_reason: str
    metrics: RequestMetrics  # the request's, from the Generator
    load_s: float  # seconds loading the engine folder

    def as_dict(self) -> dict:
        """The JSON `trt-spec generate --json` prints: the metrics with load_s among them."""
        return {"text": self.text, "token_ids": self.token_ids,
                "finish_reason": self.finish_reason,
                "metrics": {**self.metrics.to_dict(), "load_s": self.load_s}}


def request_max_len(prompt_tokens: int, max_tokens: int, num_draft_tokens: int) -> int:
    """KV-cache rows for one request: prompt + answer + one speculative step, rounded up to
    whole blocks of ROWS, at least ROWS and at most MAX_LEN."""
    need = prompt_tokens + max_tokens + num_draft_tokens + 1
    return min(MAX_LEN, max(ROWS, -(-need // ROWS) * ROWS))


def generate_one(engine: str | Path, prompt: str, config: RuntimeConfig,
                 params: SamplingParams, chat: bool | None = None) -> Answer:
    """Answers `prompt` on the engine folder with `config` (its method, k, backend, ...) and
    `params`; the KV cache is sized for this one request. Raises ValueError for a bad engine
    folder, method, backend or sampling setting."""
    from trt_spec.runtime.generator import Generator, encode_prompt
    from trt_spec.runtime.scheduler import generate
    from trt_spec.runtime.tokenizer import Tokenizer

    tokenizer, max_len = None, MAX_LEN
    if (Path(engine) / "tokenizer.json").is_file():
        tokenizer = Tokenizer(engine, config.chat_template)
        max_len = request_max_len(len(encode_prompt(tokenizer, prompt, chat)), params.max_tokens,
                                  config.speculation.num_draft_tokens)
    gen = Generator(engine, dataclasses.replace(config, max_len=max_len), tokenizer=tokenizer)
    result = generate(gen, [prompt], params, chat=chat)[0]
    return Answer(result.text, result.token_ids, result.finish_reason, result.metrics,
                  gen.load_seconds)


def summary_line(answer: Answer) -> str:
    """One line of what the answer cost: tokens, decode rate, first token, tau, drafts."""
    m = answer.metrics
    rate = m.decode_tokens_per_s
    line = (f"[{m.completion_tokens} tokens, "
            f"{'n/a' if rate is None else f'{rate:.1f}'} tokens/s decode, "
            f"first token {1000 * m.time_to_first_token_s:.0f} ms, tau {m.tau:.2f}")
    if m.proposed_tokens:
        per_pos = " ".join(f"{a:.2f}" for a in m.acceptance_per_position)
        line += (f", accepted {m.accepted_tokens}/{m.proposed_tokens} drafts "
                 f"(by position: {per_pos}), propose {1000 * m.propose_s:.0f} ms, "
                 f"score {1000 * m.score_s:.0f} ms, sample {1000 * m.sample_s:.0f} ms")
    return line + f", finish: {answer.finish_reason}]"
