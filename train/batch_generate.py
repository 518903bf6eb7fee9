"""A batched, continuously refilled generator over the export modules, for training data.

Self-distilled training text is millions of tokens of the target's own answers, so the answer
generator is the data stage's whole cost. transformers' `generate` pads a fixed batch to its
longest prompt and keeps finished rows in it; this loop keeps every cache slot busy instead:

    slots      a static KV cache per layer, [slots, kv_heads, max_len, head_dim]; the running
               sequences are kept packed in slots [0, n) (a finished one's slot takes the last
               running sequence's cache), so a step decodes exactly the n running rows
    admit      waiting jobs fill the free slots, prefilled together (right-padded, causal)
    step       one token for each running row: per-row positions, the keys up to each row's
               own length (a boolean mask), grouped-query attention without repeating K/V
    finish     at a stop token, at the job's token budget, or at the cache's end

It computes what TargetModel.forward computes (tests/test_batch_generate.py checks the
logits against it), in `dtype`: bfloat16 on a CPU with AVX-512 BF16 runs ~2.3x the fp32
matmuls, and on CUDA the same loop runs on the GPU. The answers are the model's own text; the
teacher's targets for training are computed afterwards in a separate teacher-forced pass
(train/features.py, train/live.py), so the generator's precision only changes which of two
near-tied tokens an answer takes.
"""

from __future__ import annotations

import copy
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Iterable

import torch
from torch.nn import functional as F

from trt_spec.export.model import TargetModel, layer_rope
from trt_spec.plugins.rms_norm import rms_norm
from trt_spec.train.forward import causal_attention, heads


@dataclass
class Job:
    key: object  # the caller's handle, returned with the answer
    prompt: list[int]
    max_new_tokens: int
    temperature: float = 0.0  # 0: greedy


@dataclass
class Answer:
    key: object
    tokens: list[int]  # the answer, without its stop token
    stopped: bool  # ended at a stop token (else: the budget or the cache ran out)


@dataclass
class Continue:
    """on_answer's reply to go on in the same slot: the tokens that follow the answer (its
    end of turn and the next prompt; the cache keeps everything before them) and the next
    answer's handle and budget (the temperature stays)."""
    key: object
    tokens: list[int]
    max_new_tokens: int


@dataclass
class GenStats:
    new_tokens: int = 0
    prompt_tokens: int = 0
    steps: int = 0
    seconds: float = 0.0
    by_batch: dict = field(default_factory=dict)  # running rows -> steps (occupancy)

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.seconds if self.seconds > 0 else 0.0


class BatchedGenerator:
    def __init__(self, target: TargetModel, slots: int = 64, max_len: int = 1024,
                 device: str = "cpu", dtype: torch.dtype = torch.bfloat16, seed: int = 0):
        if slots < 1:
            raise ValueError(f"slots {slots}: must be >= 1")
        if max_len < 2:
            raise ValueError(f"max_len {max_len}: must be >= 2")
        c = target.config
        # a copy: the caller's target stays in its dtype (the teacher pass reads it)
        self.model = copy.deepcopy(target).to(device=device, dtype=dtype).eval()
        self.config = c
        self.slots, self.max_len, self.device, self.dtype = slots, max_len, device, dtype
        shape = (slots, c.num_kv_heads, max_len, c.head_dim)
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(c.num_layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device)
                       for _ in range(c.num_layers)]
        self.rope = [tuple(t.to(device) for t in layer_rope(self.model, c, i))
                     for i in range(c.num_layers)]
        self.generator = torch.Generator(device=device).manual_seed(seed)

    # --- the two forwards ------------------------------------------------------------

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.model.embed_tokens(ids)
        return h * self.config.embed_scale if self.config.embed_scale != 1.0 else h

    @torch.no_grad()
    def prefill(self, slots: list[int], prompts: list[list[int]]) -> torch.Tensor:
        """Writes each prompt into its slot's cache (from position 0); -> the logits after
        each prompt's last token [len(slots), vocab] (fp32)."""
        c, m = self.config, self.model
        b, t = len(prompts), max(len(p) for p in prompts)
        ids = torch.zeros((b, t), dtype=torch.long)
        for i, p in enumerate(prompts):
            ids[i, :len(p)] = torch.tensor(p)
        ids = ids.to(self.device)
        lengths = torch.tensor([len(p) for p in prompts], device=self.device)
        index = torch.tensor(slots, device=self.device)
        positions = torch.arange(t, device=self.device)
        group = c.num_heads // c.num_kv_heads
        h = self._embed(ids)
        x = rms_norm(h, m.layers[0].input_layernorm, c.rms_norm_eps)
        for i, layer in enumerate(m.layers):
            cos, sin = self.rope[i]
            cos, sin = cos[positions][None, None], sin[positions][None, None]
            q, k, v = heads(layer, x, cos, sin)
            self.keys[i][index, :, :t] = k
            self.values[i][index, :, :t] = v
            a = causal_attention(q, k, v, positions, layer.window, group)
            nxt = m.layers[i + 1].input_layernorm if i + 1 < c.num_layers else m.norm
            x, h = layer.residual(a.transpose(1, 2).reshape(b, t, -1), h, nxt)
        last = x[torch.arange(b, device=self.device), lengths - 1]
        return m.head(last).float()

    @torch.no_grad()
    def extend(self, slot: int, tokens: list[int], offset: int) -> torch.Tensor:
        """Appends tokens to the sequence in `slot`, whose cache holds `offset` positions (a
        conversation's next turn after its answer, without reading the context again);
        -> the logits after the last one [vocab] (fp32)."""
        c, m = self.config, self.model
        t, end = len(tokens), offset + len(tokens)
        positions = torch.arange(offset, end, device=self.device)
        back = positions[:, None] - torch.arange(end, device=self.device)[None, :]  # (t, end)
        group = c.num_heads // c.num_kv_heads
        h = self._embed(torch.tensor([tokens], device=self.device))
        x = rms_norm(h, m.layers[0].input_layernorm, c.rms_norm_eps)
        for i, layer in enumerate(m.layers):
            cos, sin = self.rope[i]
            cos, sin = cos[positions][None, None], sin[positions][None, None]
            q, k, v = heads(layer, x, cos, sin)
            self.keys[i][slot, :, offset:end] = k[0]
            self.values[i][slot, :, offset:end] = v[0]
            mask = (back >= 0) & ((back < layer.window) if layer.window else True)
            a = F.scaled_dot_product_attention(
                q, self.keys[i][slot:slot + 1, :, :end].repeat_interleave(group, 1),
                self.values[i][slot:slot + 1, :, :end].repeat_interleave(group, 1),
                attn_mask=mask)
            nxt = m.layers[i + 1].input_layernorm if i + 1 < c.num_layers else m.norm
            x, h = layer.residual(a.transpose(1, 2).reshape(1, t, -1), h, nxt)
        return m.head(x[0, -1]).float()

    @torch.no_grad()
    def decode(self, tokens: torch.Tensor, positions: torch.Tensor,
               span: int | None = None) -> torch.Tensor:
        """One token for each of the running slots [0, n): tokens [n] at positions [n] ->
        logits [n, vocab] (fp32); their keys and values are written at those positions.
        span: max(positions) + 1 when the caller knows it (no device sync)."""
        c, m = self.config, self.model
        n = tokens.shape[0]
        group = c.num_heads // c.num_kv_heads
        if span is None:
            span = int(positions.max()) + 1  # keys past every row's position are never read
        rows = torch.arange(n, device=self.device)
        keys_at = torch.arange(span, device=self.device)
        back = positions[:, None] - keys_at[None, :]  # (n, span)
        scale = c.head_dim ** -0.5
        bias = {}  # window (0: none) -> additive mask [n, 1, 1, span]: 0 or -inf
        for layer in m.layers:
            if layer.window not in bias:
                ok = (back >= 0) & ((back < layer.window) if layer.window else True)
                bias[layer.window] = torch.zeros(ok.shape, device=self.device).masked_fill(
                    ~ok, float("-inf"))[:, None, None, :]
        h = self._embed(tokens[:, None])
        x = rms_norm(h, m.layers[0].input_layernorm, c.rms_norm_eps)
        for i, layer in enumerate(m.layers):
            cos, sin = self.rope[i]
            cos, sin = cos[positions][:, None, None], sin[positions][:, None, None]
            q, k, v = heads(layer, x, cos, sin)
            self.keys[i][rows, :, positions] = k[:, :, 0]
            self.values[i][rows, :, positions] = v[:, :, 0]
            # q heads of one kv head are consecutive: [n, kvh, group, hd] against that head.
            # keys @ q^T (not q @ keys^T) reads the cache slice in place; CPU's fused
            # attention is slower than these matmuls for a few query rows.
            scores = torch.matmul(self.keys[i][:n, :, :span], q.reshape(
                n, c.num_kv_heads, group, c.head_dim).transpose(-1, -2))  # [n, kvh, span, g]
            scores = scores.transpose(-1, -2).float() * scale + bias[layer.window]
            a = torch.matmul(scores.softmax(-1).to(self.dtype), self.values[i][:n, :, :span])
            nxt = m.layers[i + 1].input_layernorm if i + 1 < c.num_layers else m.norm
            x, h = layer.residual(a.reshape(n, 1, -1), h, nxt)
        return m.head(x[:, 0]).float()

    def _move(self, src: int, dst: int) -> None:
        for cache in (*self.keys, *self.values):
            cache[dst] = cache[src]

    # --- the loop --------------------------------------------------------------------

    def sample(self, logits: torch.Tensor, temperatures: torch.Tensor) -> torch.Tensor:
        """Greedy where the temperature is 0, else a draw from softmax(logits / T)."""
        greedy = logits.argmax(-1)
        hot = temperatures > 0
        if not bool(hot.any()):
            return greedy
        probs = torch.softmax(logits[hot] / temperatures[hot, None], -1)
        # inverse CDF: ~40x torch.multinomial's time on CPU for a 50k vocabulary
        cdf = probs.cumsum(-1)
        u = torch.rand((cdf.shape[0], 1), generator=self.generator, device=cdf.device)
        drawn = torch.searchsorted(cdf, u * cdf[:, -1:])[:, 0].clamp_max(cdf.shape[1] - 1)
        out = greedy.clone()
        out[hot] = drawn
        return out

    def run(self, jobs: Iterable[Job] | deque, stop_ids: set[int],
            on_answer: Callable[[Answer], Continue | None], stats: GenStats | None = None,
            max_prefill_tokens: int = 4096, tick: Callable[[GenStats], None] | None = None,
            tick_seconds: float = 60.0,
            on_dropped: Callable[[object], None] | None = None) -> GenStats:
        """Answers every job (in the order they finish) through on_answer. `jobs` may be a
        deque (or anything with bool() and popleft()) that on_answer adds to (a
        conversation's next turn): the run ends when it is empty and every sequence has
        finished. on_answer may return a Continue: the sequence then goes on in its slot
        (its next tokens are read on top of the cache), when the cache has room for them and
        one more token (else on_dropped(its key) is called and the slot freed). A prompt is cut to its last max_len - max_new_tokens tokens. tick(stats) is
        called every tick_seconds (progress on long runs; stats.seconds is up to date)."""
        stats = stats if stats is not None else GenStats()
        source = jobs if hasattr(jobs, "popleft") else deque(jobs)
        pending: list[Job] = []
        running: list[tuple[Job, list[int]]] = []  # slot i: (job, its answer so far)
        last = torch.zeros(self.slots, dtype=torch.long, device=self.device)
        pos = torch.zeros(self.slots, dtype=torch.long, device=self.device)
        temps = torch.zeros(self.slots, dtype=torch.float32, device=self.device)
        hpos = [0] * self.slots  # pos on the host: no device sync per row
        start = last_tick = time.perf_counter()
        base = stats.seconds

        extend: dict[int, list[int]] = {}  # slot -> tokens to append before it goes on

        def finish(i: int, stopped: bool) -> None:
            job, answer = running[i]
            more = on_answer(Answer(job.key, answer, stopped))
            if more is not None:
                # the answer's last token is not in the cache yet (a stop token is not kept)
                tokens = ([] if stopped else answer[-1:]) + list(more.tokens)
                if hpos[i] + len(tokens) + 1 < self.max_len:
                    running[i] = (Job(more.key, [], more.max_new_tokens, job.temperature), [])
                    extend[i] = tokens
                    return
                if on_dropped is not None:
                    on_dropped(more.key)
            tail = len(running) - 1
            if i != tail:  # keep slots [0, n) packed
                self._move(tail, i)
                running[i], hpos[i] = running[tail], hpos[tail]
                last[i], pos[i], temps[i] = last[tail], pos[tail], temps[tail]
                if tail in extend:
                    extend[i] = extend.pop(tail)
            running.pop()

        def go_on() -> None:
            """The sequences that continue in their slot: their next tokens, read at once."""
            while extend:
                i, tokens = extend.popitem()
                logits = self.extend(i, tokens, hpos[i])
                stats.prompt_tokens += len(tokens)
                hpos[i] += len(tokens)
                pos[i] = hpos[i]
                drawn = self.sample(logits[None], temps[i:i + 1])
                last[i] = drawn[0]
                settle(i, int(drawn[0]))

        def settle(i: int, token: int) -> bool:
            """Appends token to slot i's answer; True when the sequence ended (and left)."""
            job, answer = running[i]
            if token in stop_ids:
                finish(i, True)
                return True
            answer.append(token)
            stats.new_tokens += 1
            if len(answer) >= job.max_new_tokens or hpos[i] + 1 >= self.max_len:
                finish(i, False)
                return True
            return False

        while True:
            while source and len(pending) < self.slots:
                pending.append(source.popleft())
            free = self.slots - len(running)
            if free and pending:
                admit, budget = [], max_prefill_tokens
                while pending and len(admit) < free:
                    job = pending[0]
                    keep = max(1, self.max_len - max(1, job.max_new_tokens))
                    job.prompt = job.prompt[-keep:]
                    if admit and len(job.prompt) > budget:
                        break
                    budget -= len(job.prompt)
                    admit.append(pending.pop(0))
                first = len(running)
                slots = list(range(first, first + len(admit)))
                logits = self.prefill(slots, [j.prompt for j in admit])
                t = torch.tensor([j.temperature for j in admit], dtype=torch.float32,
                                 device=self.device)
                drawn = self.sample(logits, t)
                tokens = drawn.tolist()
                stats.prompt_tokens += sum(len(j.prompt) for j in admit)
                lengths = [len(j.prompt) for j in admit]
                new = slice(first, first + len(admit))
                pos[new] = torch.tensor(lengths, device=self.device)
                temps[new], last[new], hpos[new] = t, drawn, lengths
                running += [(j, []) for j in admit]
                # settle from the highest slot down: a finish moves the tail into its slot
                for s, tok in sorted(zip(slots, tokens), reverse=True):
                    settle(s, tok)
                go_on()
                continue
            if not running:
                if not source and not pending:
                    break
                continue
            n = len(running)
            logits = self.decode(last[:n], pos[:n], max(hpos[:n]) + 1)
            drawn = self.sample(logits, temps[:n])
            stats.steps += 1
            stats.by_batch[n] = stats.by_batch.get(n, 0) + 1
            pos[:n] += 1
            hpos[:n] = [p + 1 for p in hpos[:n]]
            last[:n] = drawn
            tokens = drawn.tolist()  # the step's one sync
            if tick is not None and time.perf_counter() - last_tick > tick_seconds:
                last_tick = time.perf_counter()
                stats.seconds = base + last_tick - start
                tick(stats)
            for i in range(n - 1, -1, -1):  # high to low: finishing moves the tail down
                settle(i, tokens[i])
            go_on()
        stats.seconds = base + time.perf_counter() - start
        return stats
