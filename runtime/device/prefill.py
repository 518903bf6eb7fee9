"""Prefill on the device executor (runtime/device/loop.py): chunked prompts, prefix-cache hits
and the choices of one request (n > 1), as the host executor (runtime/engine.py) reads them.

    admit(loop, s, source):                     # at admission (runtime/executors.py admit)
        seq[slot, :P] = prompt
        source, s's request's choice 0 on this loop:
            prefilled     -> fork now: rows [0, P - 1) copied from its slot
            not yet       -> s.fork_of = source: s waits, forked after source's last chunk
        else, the prefix cache on: the longest prefix of the prompt among this loop's kept
            rows (released streams') and running streams' rows, at least min_tokens, at most
            P - 1 (the last prompt token is read for its logits) -> rows [0, n) copied
        s.prefill_pos = s.stats.cached_tokens = n   # counted as the host counts it

    read(loop, chunks):                         # one forward per loop and step
        (stream, n): the next n prompt tokens of each, at positions prefill_pos ..
            (runtime/stream.py prefill_chunks: the scheduler's max_prefill_tokens in all)
        the target's rows written in place; the drafter keeps what it reads per row
        a stream whose prompt is then read: its state, its first token sampled on the
        device (the host executor's token: argmax, or the race of its seed at output
        position 0), its drafter caught up; its waiting choices forked; it decodes from the
        next step (`activate`, after this step's decode), as on the host

The rows a slot holds stay valid in its loop's caches after the stream is released, until a
stream of the same loop takes the slot (a slot is active in one loop at a time; a host
stream writes the host's caches): `Kept` tracks them by token ids, so a hit is exact. A
slot copy is a tensor copy on the device, every layer (and the heads' hidden rows), no host
round trip.
"""

from __future__ import annotations

import numpy as np
import torch

from trt_spec.runtime.device import prompt_logprobs
from trt_spec.runtime.device.controls import DeviceControls
from trt_spec.runtime.prefix_cache import common_prefix
from trt_spec.runtime.race_torch import signed
from trt_spec.runtime.stream import Stream


class Kept:
    """Per loop: slot -> the token ids of the rows [0, len) its caches hold for a released
    stream (valid until a stream of this loop takes the slot)."""

    def __init__(self):
        self.rows: dict[int, list[int]] = {}

    def find(self, prompt: list[int], running: list[Stream], min_tokens: int
             ) -> tuple[int, int] | None:
        """(slot, n): the longest prefix of `prompt` this loop's caches hold, kept or a running
        stream's (its rows read so far), n >= min_tokens and <= len(prompt) - 1; kept first
        (a tie keeps the kept slot)."""
        limit = len(prompt) - 1
        candidates = list(self.rows.items()) + [(r.slot, rows_of(r)) for r in running]
        best = None
        for slot, tokens in candidates:
            n = min(common_prefix(tokens, prompt), limit)
            if n >= min_tokens and (best is None or n > best[1]):
                best = (slot, n)
        return best


def rows_of(s: Stream) -> list[int]:
    """The token ids of the rows s's slot holds in its loop's target cache: the prompt read so
    far, then (prefilled) every token but the last emitted one (it has no row yet)."""
    if not s.prefilled:
        return s.prompt_ids[:s.prefill_pos]
    seq = s.prompt_ids + s.output_ids
    return seq[:len(seq) - 1]


def copy_slot(loop, src: int, dst: int, n: int) -> None:
    """Rows [0, n) of slot src into slot dst in loop's caches: the target's, and the heads'
    hidden rows (a drafter's own caches are rebuilt by its prefill)."""
    if src == dst or n == 0:
        return
    for b in loop.cache:
        b[dst, :, :n] = b[src, :, :n]
    hist = getattr(loop.drafter, "hist", None)
    if hist is not None:
        hist[dst, :n] = hist[src, :n]


def admit(ex, loop, s: Stream, source: Stream | None) -> None:
    """s (its slot allocated) joins `loop`: its prompt in seq, its rows started from a fork
    of `source` (choice 0 of its request) or a prefix-cache hit (module docstring)."""
    prompt = torch.tensor(s.prompt_ids, dtype=torch.long)
    loop.state.seq[s.slot, :len(s.prompt_ids)] = prompt.to(loop.device)
    loop.state.active[s.slot] = False
    hit = None
    if source is not None and source.slot is not None and ex.loop(source) is loop:
        if not source.prefilled and not source.finished:
            s.fork_of = source  # forked after source's last chunk (fork)
            loop.kept.rows.pop(s.slot, None)
            return
        hit = (source.slot, len(s.prompt_ids) - 1) if source.prefill_pos else None
    prefix = ex.gen.prefix_cache
    if hit is None and prefix is not None and s.params.prompt_logprobs is None:
        running = [r for r in ex.gen.engine.running.values()
                   if r is not s and r.executor == "device" and ex.loop(r) is loop
                   and r.slot is not None]
        hit = loop.kept.find(s.prompt_ids, running, prefix.min_tokens)
    start(loop, s, hit, prefix)


def start(loop, s: Stream, hit: tuple[int, int] | None, prefix) -> None:
    """s's prefill starts after the hit's rows, copied into its slot; counted as cached."""
    n = 0
    if hit is not None:
        copy_slot(loop, hit[0], s.slot, hit[1])
        n = hit[1]
    loop.kept.rows.pop(s.slot, None)  # (its rows are s's now)
    s.prefill_pos = s.stats.cached_tokens = n
    if prefix is not None:
        prefix.record(len(s.prompt_ids), n)


def fork(loop, source: Stream, streams: list[Stream], prefix) -> None:
    """The choices waiting on source (its prompt now read) start from its rows, all but the
    last prompt token (read again for each one's own first token)."""
    for c in streams:
        if c.fork_of is source:
            c.fork_of = None
            start(loop, c, (source.slot, len(c.prompt_ids) - 1), prefix)


def keep(loop, s: Stream) -> None:
    """s is released: its slot's rows stay valid in loop's caches until reused."""
    tokens = rows_of(s)
    if tokens:
        loop.kept.rows[s.slot] = tokens


def read(loop, chunks: list[tuple[Stream, int]]) -> list[tuple[Stream, int, torch.Tensor]]:
    """One target forward over the next n prompt tokens of each (stream, n) (slots of one
    loop); -> (stream, its first token, its logits row [1, V] on the device) for each whose
    prompt is now read (the others wait for their next chunk)."""
    s = loop.state
    lo = min(st.slot for st, _ in chunks)
    hi = max(st.slot for st, _ in chunks) + 1
    t = max(n for _, n in chunks)
    ids = np.zeros((hi - lo, t), dtype=np.int64)
    past = np.zeros(hi - lo, dtype=np.int64)
    q = np.zeros(hi - lo, dtype=np.int64)
    done = np.zeros(hi - lo, dtype=bool)
    for st, n in chunks:
        i, pos = st.slot - lo, st.prefill_pos
        ids[i, :n] = st.prompt_ids[pos:pos + n]
        ids[i, n:] = st.prompt_ids[pos + n - 1]  # padding: a real token (loop.py _score)
        past[i], q[i] = pos, n
        done[i] = pos + n == len(st.prompt_ids)
    ids_d, past_d, q_d, done_d = (torch.from_numpy(x).to(loop.device)
                                  for x in (ids, past, q, done))
    every = prompt_logprobs.wanted([st for st, _ in chunks])  # logits at every chunk row
    out = loop.forward(loop.target, loop.cache, lo, hi, ids_d, past_d, q_d,
                       prompt_logprobs.logits_index(q_d, t, every))
    if every:
        prompt_logprobs.record(chunks, lo, out[0])
    last = out[0][:, -1:]  # (b, 1, V) each stream's last row of this chunk
    rows = dict(zip(loop.target.outputs, out[1:]))
    if loop.drafter is not None:
        loop.drafter.read(loop, lo, hi, q_d > 0, past_d, q_d, rows)
    for st, n in chunks:
        st.prefill_pos += n
    finished = [st for st, _ in chunks if st.prefill_pos == len(st.prompt_ids)]
    if not finished:
        return []
    tokens = first(loop, finished, lo, last, past_d + q_d, done_d)
    return [(st, int(tokens[st.slot - lo]), last[st.slot - lo]) for st in finished]


def first(loop, streams: list[Stream], lo: int, logits: torch.Tensor, prompt_len: torch.Tensor,
          done: torch.Tensor) -> np.ndarray:
    """The streams whose prompts are read (done [B] over slots lo..): their sampling state,
    first token (logits [B, 1, V]) in seq, their drafter caught up -> the tokens [B]."""
    s = loop.state
    hi = lo + logits.shape[0]
    for st in streams:
        p, n = st.params, len(st.prompt_ids)
        s.temperature[st.slot] = 1.0 if p.greedy else p.temperature
        s.top_k[st.slot] = p.top_k if p.top_k < loop.vocab_size else 0  # (>= V: off)
        s.top_p[st.slot] = p.top_p
        s.greedy[st.slot] = p.greedy
        s.end[st.slot] = n + p.max_tokens
        s.seed[st.slot] = signed(p.seed)  # (every stream has one: runtime/stream.py)
        s.start[st.slot] = n
    if loop.controls is None and any(st.params.controls for st in streams):
        loop.controls = DeviceControls(loop.slots, loop.vocab_size, loop.device, loop.state)
    for st in streams if loop.controls is not None else ():
        if loop.controls.admit(st):  # the masks' tensors made or grown: new addresses
            loop.graphs.clear()
    loop.sample_for(streams)
    tokens = loop.first_tokens(streams, lo, logits)
    if loop.controls is not None:
        loop.controls.count(lo, hi, tokens[:, None], done[:, None])
    at = torch.where(done, prompt_len, loop.length - 1)  # other slots of the range: the dump
    s.seq[lo:hi].scatter_(1, at[:, None], tokens[:, None])
    s.n[lo:hi] = torch.where(done, prompt_len + 1, s.n[lo:hi])
    if loop.drafter is not None:
        loop.drafter.prefill(loop, lo, hi, done, prompt_len)
    return tokens.cpu().numpy()


def activate(loop, streams: list[Stream]) -> None:
    """The streams prefilled this step decode from the next one: active only after this
    step's decode (a slot active in the decode's range would step unread)."""
    for s in streams:
        if not s.finished:
            loop.state.active[s.slot] = True
