"""The scheduler: the one loop under the Python API (`LLM`) and the HTTP server.

    prepare(prompt ids, params, method, k) -> a Request, checked once (FieldError naming
                                               the field) with its Stream and grammar guide;
                                               params.n > 1: one Request per choice
    enqueue(request)                 -> the waiting queue, every choice or none (bounded:
                                        past it, QueueFull)
    step():                          # one iteration
        apply cancellations                      (a running stream's KV slot is freed now)
        admit waiting requests while a KV slot is free            (continuous batching;
                                                                  choice i > 0 of a request
                                                                  starts from choice 0's
                                                                  prompt rows: Engine.fork)
        execute the running streams, each on the executor chosen at its admission
        (runtime/executors.py: one place, from the methods' traits and the backend):
          host    engine.step(its streams, max_prefill_tokens)    (one engine, every method:
                  prefill, then one target forward for every decode/verify row; a long
                  prompt is read in chunks over several steps while the other streams keep
                  decoding; a stream whose own part of the step fails ends alone)
          device  device_executor.step(its streams, max_prefill_tokens) (device/loop.py:
                  the same on the device, per (method, k); the host reads what it left)
        hand each request its delta: new token ids and text (the result when finished; a
                                     failed stream's error as Request.error)

`LLM` drives `step()` itself; the server runs it in one background thread (`start`), and
talks to it only through `prepare`, `enqueue` (`submit`: both) and `cancel` (thread-safe) and
the `on_output` callbacks, which run on that thread (the server forwards them with
`loop.call_soon_threadsafe`).
`generate` / `generate_ids` (trt-spec generate, bench) run a batch to completion through
`run`: the same admission, executors and steps, on the caller's thread, errors raised.

Requests with different methods and draft lengths run side by side in the Generator's one
engine: each stream carries its method and k.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import secrets
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from trt_spec.runtime import executors
from trt_spec.runtime.detokenizer import IncrementalDetokenizer
from trt_spec.runtime.stream import RequestMetrics, StepMetrics, Stream
from trt_spec.runtime.generator import Generator, Prompt
from trt_spec.runtime.methods import DEFAULT, Speculation
from trt_spec.runtime.provenance import TokenSource
from trt_spec.runtime.sampling import SamplingParams, TokenLogprob
from trt_spec.runtime.tokenizer import Tokenizer
from trt_spec.runtime.validation import MAX_SEED, FieldError, ids_in_vocabulary

log = logging.getLogger("trt_spec.scheduler")
_ids = itertools.count()


class QueueFull(RuntimeError):
    """The waiting queue is at its bound; the caller should retry later (HTTP 429)."""


@dataclass
class Output:
    """What one step added to one request (a delta), handed to its `on_output`."""

    request: "Request"
    text: str  # new text: whole characters, never past a stop string
    token_ids: list[int]  # new token ids
    finish_reason: str | None  # None while running; "stop" | "length" | "abort" | "error"
    logprobs: list[TokenLogprob] = field(default_factory=list)  # per new token, when asked
    sources: list[TokenSource] = field(default_factory=list)  # per new token, its origin

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(eq=False)
class Request:
    """One choice of a request (OpenAI's `choices[index]`; n = 1: the request). The n
    choices share the id (cancel ends them all), the prompt and on_output."""

    id: str
    stream: Stream  # its method and k, tokens, slot
    detok: IncrementalDetokenizer | None  # None: nobody reads its text as it comes (run)
    on_output: Callable[[Output], None] | None = None
    t_submitted: float = field(default_factory=time.perf_counter)
    sent_tokens: int = 0
    done: bool = False  # the final Output was handed out
    error: str | None = None
    index: int = 0  # of the choice, 0..n-1
    # every choice of the request in index order, this one included (one list, shared)
    choices: list["Request"] = field(default_factory=list)

    def __post_init__(self):
        if not self.choices:
            self.choices = [self]

    @property
    def method(self) -> str:
        return self.stream.method

    @property
    def num_draft_tokens(self) -> int:
        return self.stream.num_draft_tokens


@dataclass
class StepReport:
    """What one scheduler step did, returned as data (the server's metrics read it)."""

    engine: StepMetrics | None = None  # None: no stream ran
    admitted: list[Request] = field(default_factory=list)
    finished: list[Request] = field(default_factory=list)
    new_tokens: int = 0


class Scheduler:
    def __init__(self, gen: Generator, step_delay: float = 0.0):
        """The generator's settings (gen.settings) give the default method and k, the prefill
        budget per step (max_prefill_tokens) and the waiting queue's bound (max_waiting).
        step_delay: seconds slept after each step (tests: a slower model)."""
        self.gen = gen
        self.max_prefill_tokens = gen.settings.max_prefill_tokens
        self.max_waiting = gen.settings.max_waiting
        self.step_delay = step_delay
        self.on_step: Callable[[StepReport], None] | None = None
        self._cond = threading.Condition()
        self._waiting: deque[Request] = deque()  # guarded by _cond
        self._cancelled: set[str] = set()  # guarded by _cond
        self._running: list[Request] = []  # the loop's own
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._raise = False  # run(): an error ends the run instead of the request

    # -- requests (any thread) -------------------------------------------------------------

    @property
    def methods(self) -> list[str]:
        return self.gen.methods

    @property
    def default_method(self) -> str:
        return self.gen.method

    @property
    def max_len(self) -> int:
        return self.gen.cache.max_len

    @property
    def tokenizer(self) -> Tokenizer:
        return self.gen.tokenizer

    def encode(self, prompt: Prompt, chat: bool | None = None) -> list[int]:
        """A prompt's token ids (runtime/generator.py encode_prompt: chat template or not)."""
        return self.gen.encode(prompt, chat)

    def prepare(self, prompt_ids: list[int], params: SamplingParams, spec: Speculation = DEFAULT,
                on_output: Callable[[Output], None] | None = None,
                request_id: str | None = None) -> Request:
        """A request checked, here and only here, and its Stream built, not yet queued
        (`enqueue`): its method and k resolved (None takes the configured default), its prompt
        and max_tokens fitted to the context, its structure compiled into the Stream's guide
        (slow the first time: the server calls this off its event loop) -> the Request of
        choice 0, its `choices` all n, choice i seeded seed + i (mod 2^64; no seed: one drawn
        here). FieldError naming the field: "speculative" (method or k), "prompt",
        "max_tokens", "n", "logit_bias" or the structure's (validation.STRUCTURES)."""
        try:
            method, k, adaptive = self.gen.resolve(spec)
        except ValueError as e:
            raise FieldError("speculative", str(e)) from None
        self._check_fits(prompt_ids, params)
        params = self.gen.with_model_stops(params)
        request_id = request_id or f"req-{next(_ids)}"
        seed = secrets.randbits(64) if params.seed is None else params.seed  # (reported)
        choices = []
        for i in range(params.n):
            p = dataclasses.replace(params, seed=(seed + i) % (MAX_SEED + 1))
            stream = Stream(list(prompt_ids), p, method, k, adaptive=adaptive,
                            guide=self._guide(p))
            choices.append(Request(request_id, stream, IncrementalDetokenizer(
                self.gen.tokenizer, p.stop, p.skip_special_tokens), on_output, index=i))
        for c in choices:
            c.choices = choices
        return choices[0]

    def _guide(self, params: SamplingParams):
        """The request's structure compiled into a guide (one per choice), or None."""
        try:
            return self.gen.guide(params)
        except FieldError:
            raise
        except ValueError as e:  # llguidance is not installed
            raise FieldError(params.structure[0], str(e)) from None

    def _check_fits(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """FieldError unless the prompt's ids and logit_bias's are in the vocabulary and the
        prompt and max_tokens fit the context."""
        vocab = self.gen.config.vocab_size
        if not prompt_ids:
            raise FieldError("prompt", "the prompt is empty: at least one token is needed")
        bad = [t for t in prompt_ids if not (isinstance(t, int) and 0 <= t < vocab)]
        if bad:
            raise FieldError("prompt", f"prompt token ids {bad[:4]} are outside 0..{vocab - 1}")
        ids_in_vocabulary(params, vocab)
        n = len(prompt_ids)
        if n >= self.max_len:
            raise FieldError("prompt", f"the prompt has {n} tokens; the context holds "
                             f"{self.max_len} (prompt + output), so at most {self.max_len - 1} "
                             "prompt tokens")
        if n + params.max_tokens > self.max_len:
            raise FieldError("max_tokens", f"max_tokens={params.max_tokens}: the prompt has {n} "
                             f"tokens and the context holds {self.max_len}, so at most "
                             f"{self.max_len - n} new tokens")
        most = min(self.slots, self.max_waiting or self.slots)
        if params.n > most:
            bound = f"--max-num-seqs {self.slots}" + (
                f", --max-waiting {self.max_waiting}" if most < self.slots else "")
            raise FieldError("n", f"n={params.n}: at most {most} choices per request ({bound}; "
                                  "each choice decodes in a KV slot of its own)")

    def enqueue(self, r: Request) -> Request:
        """Queues a prepared request, all its choices or none; QueueFull past the waiting
        queue's bound (each choice counts) or once the scheduler is stopping."""
        return self.enqueue_all([r])[0]

    def enqueue_all(self, requests: list[Request]) -> list[Request]:
        """Queues prepared requests together (the prompts of one HTTP request), every choice
        of each: all of them, or none and QueueFull when they would pass the waiting queue's
        bound or the scheduler is stopping."""
        with self._cond:
            if self._stopping:
                raise QueueFull("the server is shutting down")
            choices = [c for r in requests for c in r.choices]
            waiting, n = len(self._waiting), len(choices)
            if self.max_waiting is not None and waiting + n > self.max_waiting:
                more = "" if n == 1 else (f"; this one has {n} choices" if len(requests) == 1
                                          else f"; these {n} (one per prompt and choice)")
                raise QueueFull(f"{waiting} requests are already waiting (the bound is "
                                f"{self.max_waiting}{more}); retry later")
            now = time.perf_counter()
            for c in choices:
                c.t_submitted = now
                self._waiting.append(c)
            self._cond.notify()
        return requests

    def submit(self, prompt_ids: list[int], params: SamplingParams, spec: Speculation = DEFAULT,
               on_output: Callable[[Output], None] | None = None,
               request_id: str | None = None) -> Request:
        """prepare, then enqueue."""
        return self.enqueue(self.prepare(prompt_ids, params, spec, on_output, request_id))

    def run(self, streams: list[Stream]) -> list[Stream]:
        """Runs `streams` (from gen.stream) to completion on this thread, through the same
        admission and steps as submitted requests, every prompt read whole (no prefill
        budget); an error raises here. The loop under generate_ids."""
        assert self._thread is None, "run() drives the steps itself"
        budget, self.max_prefill_tokens, self._raise = self.max_prefill_tokens, None, True
        try:
            with self._cond:
                self._waiting.extend(Request(f"run-{next(_ids)}", s, None) for s in streams)
            while self.has_work():
                self.step()
        except BaseException:
            for r in self._running:  # the run ends here: free the slots it holds
                self._release(r, keep=False)
            self._running = []
            with self._cond:
                self._waiting.clear()
            raise
        finally:
            self.max_prefill_tokens, self._raise = budget, False
        return streams

    def cancel(self, request_id: str) -> None:
        """Ends the request at the next step and frees its KV slot (no-op when finished)."""
        with self._cond:
            self._cancelled.add(request_id)
            self._cond.notify()

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def slots(self) -> int:
        """KV-cache slots in all (max_num_seqs)."""
        return self.gen.cache.slots

    @property
    def slots_used(self) -> int:
        cache = self.gen.cache
        return cache.slots - cache.free_slots

    @property
    def slots_kept(self) -> int:
        """Free slots keeping a finished request's rows for the prefix cache."""
        return len(self.gen.cache.kept)

    @property
    def suffix_cache_tokens(self) -> tuple[int, int]:
        """(tokens held, bound) of the engine's suffix lookup cache: it fills as requests end."""
        return self.gen.suffix_cache_tokens

    @property
    def prefix_caching(self) -> bool:
        return self.gen.prefix_cache is not None

    # -- the loop (one thread) -------------------------------------------------------------

    def has_work(self) -> bool:
        return bool(self._waiting or self._running or self._cancelled)

    def step(self) -> StepReport:
        report = StepReport()
        cancelled = set()
        if self._cancelled:  # (a racy read only delays a cancellation by one step)
            with self._cond:
                cancelled, self._cancelled = self._cancelled, set()
            for r in [r for r in self._running if r.id in cancelled]:
                self._release(r)
                self._end(r, "abort", report)
        self._running = [r for r in self._running if not r.done]
        if self._waiting or cancelled:  # the queue's lock only when there is work in it
            with self._cond:
                for r in [r for r in self._waiting if r.id in cancelled]:
                    self._waiting.remove(r)
                    self._end(r, "abort", report)
                free = self.gen.cache.slots - len(self._running)
                while self._waiting and len(report.admitted) < free:
                    report.admitted.append(self._waiting.popleft())
        for r in report.admitted:
            try:
                executors.admit(self.gen, r.stream, r.choices[0].stream if r.index else None)
                self._running.append(r)
            except Exception as e:  # noqa: BLE001 - e.g. a drafter graph that fails to load
                if self._raise:
                    raise
                log.exception("admitting %s", r.id)
                r.error = f"{type(e).__name__}: {e}"
                self._release(r, keep=False)
                self._end(r, "error", report)
        if self._running:
            try:
                report.engine = executors.execute(self.gen, [r.stream for r in self._running],
                                                  self.max_prefill_tokens,
                                                  [r.stream for r in report.admitted])
            except Exception as e:  # noqa: BLE001 - what the batch shares failed (a forward,
                if self._raise:         # a proposer's call): fail these requests, keep serving
                    raise
                log.exception("engine step")
                for r in self._running:
                    r.error = f"{type(e).__name__}: {e}"
                    self._release(r, keep=False)
                    r.stream.finish_reason = "error"
        for r in self._running:
            self._emit(r, report)
        self._running = [r for r in self._running if not r.done]
        if self.on_step is not None:
            self.on_step(report)
        return report

    def _release(self, r: Request, keep: bool = True) -> None:
        """Frees r's slot; keep=False after an error (its rows may be half written): the
        prefix cache keeps nothing of it."""
        executors.release(self.gen, r.stream, keep)

    def _emit(self, r: Request, report: StepReport) -> None:
        """Hands r what its stream added this step. A stream the engine failed alone
        (Stream.error: Engine.isolated, its slot already freed) ends with "error" and that
        error's message; run() raises it instead."""
        s = r.stream
        if r.done:
            return
        if s.finish_reason == "error":
            if s.error is not None:
                if self._raise:
                    raise s.error
                r.error = r.error or f"{type(s.error).__name__}: {s.error}"
            self._end(r, "error", report)
            return
        if r.detok is None:
            text = s.text if s.finished else ""
        else:
            r.detok.update(s.output_ids)
            text = r.detok.flush(s.text) if s.finished else r.detok.delta()
        ids = s.output_ids[r.sent_tokens:]
        logprobs = s.logprobs[r.sent_tokens:len(s.output_ids)]
        sources = s.sources[r.sent_tokens:len(s.output_ids)]
        r.sent_tokens = len(s.output_ids)
        report.new_tokens += len(ids)
        if s.finished:
            r.done = True
            report.finished.append(r)
        if text or ids or s.finished:
            self._hand(r, Output(r, text, ids, s.finish_reason, logprobs, sources))

    def _end(self, r: Request, reason: str, report: StepReport) -> None:
        s = r.stream
        s.finish_reason = reason
        s.stats.t_finished = s.stats.t_finished or time.perf_counter()
        r.done = True
        report.finished.append(r)
        self._hand(r, Output(r, "", [], reason))

    def _hand(self, r: Request, out: Output) -> None:
        if r.on_output is None:
            return
        try:
            r.on_output(out)
        except Exception:  # noqa: BLE001 - a consumer's bug must not stop the loop
            log.exception("on_output of %s", r.id)

    # -- background thread -----------------------------------------------------------------

    def start(self) -> None:
        assert self._thread is None, "already started"
        self._thread = threading.Thread(target=self._loop, name="trt-spec-scheduler",
                                        daemon=True)
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def stop(self, timeout: float | None = None) -> None:
        """Stops the loop; requests still waiting or running end with "abort"."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join(timeout)

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._stopping and not self.has_work():
                    self._cond.wait()
                if self._stopping:
                    break
            self.step()
            if self.step_delay:
                time.sleep(self.step_delay)
        report = StepReport()
        with self._cond:
            left, self._waiting = list(self._waiting) + self._running, deque()
        for r in left:
            self._release(r)
            self._end(r, "abort", report)
        self._running = []
        if self.on_step is not None:
            self.on_step(report)


@dataclass
class GenerationResult:
    text: str
    token_ids: list[int]
    finish_reason: str
    metrics: RequestMetrics


def generate_ids(gen: Generator, prompts_ids: list[list[int]], params: SamplingParams,
                 method: str | None = None, num_draft_tokens: int | str | None = None
                 ) -> list[Stream]:
    """Runs every prompt to completion, at most `cache.slots` at a time, through
    Scheduler.run (the admission, executors and steps the server and LLM run, on this
    thread). None takes the configured method and k (the edge of `trt-spec generate` and
    bench: its keywords become one Speculation here)."""
    if params.n != 1:
        raise ValueError(f"n={params.n}: generate / generate_ids answer each prompt once; "
                         "n choices per prompt come from LLM.generate or the server")
    spec = Speculation(method, num_draft_tokens)
    streams = [gen.stream(ids, params, spec) for ids in prompts_ids]
    return Scheduler(gen).run(streams)


def generate(gen: Generator, prompts: list[Prompt], params: SamplingParams | None = None,
             chat: bool | None = None, method: str | None = None,
             num_draft_tokens: int | str | None = None) -> list[GenerationResult]:
    """generate_ids over prompts (text or chats, runtime/generator.py's encode_prompt)."""
    params = params or SamplingParams()
    streams = generate_ids(gen, [gen.encode(p, chat) for p in prompts], params, method,
                           num_draft_tokens)
    return [GenerationResult(s.text, s.output_ids, s.finish_reason, s.metrics())
            for s in streams]
