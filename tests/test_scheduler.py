"""The scheduler on tiny engines: continuous batching across methods, cancellation, the
queue bound, and the background thread."""

import queue

import pytest

from trt_spec.runtime.generator import Generator, available_methods
from trt_spec.runtime.manifest import load_manifest
from trt_spec.runtime.methods import Speculation
from trt_spec.runtime.settings import SpeculationConfig
from trt_spec.runtime.sampling import SamplingParams
from trt_spec.runtime.scheduler import QueueFull, Scheduler
from trt_spec.runtime.scheduler import generate_ids

PROMPTS = [[5, 17, 99, 3, 17, 99], [42, 8, 77, 61, 23, 11, 90, 8, 77], [4, 4], [9, 10, 11],
           [30, 31, 30, 31, 30], [7]]


def greedy(n):
    return SamplingParams(max_tokens=n, ignore_eos=True)


def alone(engine_dir, prompt, n):
    return generate_ids(Generator(engine_dir), [prompt], greedy(n))[0].output_ids


def test_available_methods_follow_the_manifest(tiny_engine, tiny_spec_engine):
    assert available_methods(load_manifest(tiny_engine)) == ["none", "ngram", "suffix", "auto"]
    assert available_methods(load_manifest(tiny_spec_engine)) == ["none", "vanilla", "ngram",
                                                                  "suffix", "hybrid", "auto"]


def test_continuous_batching_across_methods_equals_one_at_a_time(tiny_spec_engine):
    """6 requests, 3 slots, 3 methods, different lengths: new requests are admitted between
    steps while others decode, and every greedy output is the one it has alone."""
    sched = Scheduler(Generator(tiny_spec_engine, max_batch=3, num_draft_tokens=3))
    methods = [("none", None), ("ngram", 2), ("vanilla", 3), ("vanilla", None), ("ngram", None),
               ("none", None)]
    lengths = [5, 17, 9, 12, 3, 20]
    reqs = [sched.submit(p, greedy(n), Speculation(*a))
            for p, n, a in zip(PROMPTS, lengths, methods)]
    admitted_while_running = 0
    while not all(r.done for r in reqs):
        running = sched.num_running
        report = sched.step()
        admitted_while_running += bool(report.admitted and running)
        assert sched.num_running <= 3
    assert admitted_while_running > 0
    for r, p, n in zip(reqs, PROMPTS, lengths):
        assert r.stream.output_ids == alone(tiny_spec_engine, p, n), r.method
    assert [(r.method, r.num_draft_tokens) for r in reqs] == [("none", 0), ("ngram", 2), ("vanilla", 3), ("vanilla", 3),
                                     ("ngram", 3), ("none", 0)]
    assert sum(r.stream.stats.proposed for r in reqs if r.method == "vanilla") > 0
    assert sched.slots_used == 0


def test_deltas_add_up_to_the_result(tiny_engine):
    sched = Scheduler(Generator(tiny_engine, max_batch=2))
    got = {}
    reqs = [sched.submit(p, greedy(10), on_output=lambda o: got.setdefault(o.request.id, [])
                         .append(o)) for p in PROMPTS[:3]]
    while sched.has_work():
        sched.step()
    for r in reqs:
        outs = got[r.id]
        assert [o.finished for o in outs] == [False] * (len(outs) - 1) + [True]
        assert "".join(o.text for o in outs) == r.stream.text
        assert sum((o.token_ids for o in outs), []) == r.stream.output_ids


def test_cancel_frees_the_slot_at_the_next_step(tiny_spec_engine):
    sched = Scheduler(Generator(tiny_spec_engine, max_batch=2, method="vanilla"))
    a = sched.submit(PROMPTS[0], greedy(50))
    b = sched.submit(PROMPTS[1], greedy(50))
    waiting = sched.submit(PROMPTS[2], greedy(50))
    for _ in range(3):
        sched.step()
    assert sched.slots_used == 2 and sched.num_waiting == 1
    sched.cancel(a.id)
    sched.cancel(waiting.id)
    report = sched.step()
    assert a.stream.finish_reason == "abort" and a.stream.slot is None
    assert waiting.stream.finish_reason == "abort" and waiting.stream.slot is None
    assert {r.id for r in report.finished} == {a.id, waiting.id}
    assert sched.slots_used == 1 and sched.num_waiting == 0
    assert len(a.stream.output_ids) < 50 and not b.done
    # the freed slot serves a new request whose output is unaffected
    c = sched.submit(PROMPTS[3], greedy(8))
    while not (b.done and c.done):
        sched.step()
    assert c.stream.output_ids == alone(tiny_spec_engine, PROMPTS[3], 8)
    assert sched.slots_used == 0


def test_a_cancelled_slot_is_reused_in_the_same_step(tiny_engine):
    sched = Scheduler(Generator(tiny_engine, max_batch=1))
    a = sched.submit(PROMPTS[0], greedy(50))
    sched.step()
    b = sched.submit(PROMPTS[1], greedy(5))
    sched.step()
    assert sched.num_waiting == 1
    sched.cancel(a.id)
    report = sched.step()
    assert report.admitted == [b] and [r.id for r in report.finished] == [a.id]
    assert b.stream.output_ids  # prefilled in that step


def test_queue_bound(tiny_engine):
    sched = Scheduler(Generator(tiny_engine, max_batch=1, max_waiting=2))
    sched.submit(PROMPTS[0], greedy(4))
    sched.submit(PROMPTS[1], greedy(4))
    with pytest.raises(QueueFull, match=r"2 requests are already waiting \(the bound is 2\)"):
        sched.submit(PROMPTS[2], greedy(4))
    sched.step()  # one admitted: room in the queue again
    sched.submit(PROMPTS[2], greedy(4))


@pytest.mark.parametrize("kwargs, message", [
    (dict(method="eagle3"), "has no eagle3 drafter (export it with --eagle3 CHECKPOINT); "
                            "methods here: none, ngram, suffix"),
    (dict(method="vanilla"), "has no vanilla drafter"),
    (dict(method="medusa"), "method 'medusa' is not known; known: none, vanilla, ngram"),
    (dict(method="ngram", num_draft_tokens=0), "num_draft_tokens=0: must be an integer in 1..64"),
    (dict(method="none", num_draft_tokens=2), "method 'none' drafts nothing"),
])
def test_bad_method(tiny_engine, kwargs, message):
    sched = Scheduler(Generator(tiny_engine))
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        sched.submit(PROMPTS[0], greedy(4), Speculation(kwargs.get("method"),
                                                        kwargs.get("num_draft_tokens")))


@pytest.mark.parametrize("prompt, n, message", [
    ([5] * 256, 1, "the prompt has 256 tokens; the context holds 256"),
    ([5] * 200, 57, "max_tokens=57: the prompt has 200 tokens and the context holds 256, so "
                    "at most 56 new tokens"),
    ([5, 128], 4, r"prompt token ids \[128\] are outside 0..127"),
    ([], 4, "the prompt is empty"),
])
def test_prompt_must_fit(tiny_engine, prompt, n, message):
    sched = Scheduler(Generator(tiny_engine))
    with pytest.raises(ValueError, match=message):
        sched.submit(prompt, greedy(n))


def test_background_thread(tiny_engine):
    sched = Scheduler(Generator(tiny_engine, max_batch=2))
    sched.start()
    try:
        outs = queue.Queue()
        reqs = [sched.submit(p, greedy(6), on_output=outs.put) for p in PROMPTS[:4]]
        finished = set()
        while len(finished) < 4:
            o = outs.get(timeout=30)
            if o.finished:
                finished.add(o.request.id)
        assert finished == {r.id for r in reqs}
        assert [r.stream.output_ids for r in reqs] == \
            [alone(tiny_engine, p, 6) for p in PROMPTS[:4]]
    finally:
        sched.stop(timeout=10)
    assert not sched.alive


def test_generate_ids_runs_on_the_schedulers_admission_and_steps(tiny_spec_engine, monkeypatch):
    """One driver of admission: generate_ids runs its streams through
    Scheduler.run (more prompts than slots, every prompt read whole, in order), and an error
    raises to its caller instead of ending the request as the server's loop does."""
    gen = Generator(tiny_spec_engine, max_batch=2, max_prefill_tokens=4)
    runs, steps = [], []
    real_run, real_step = Scheduler.run, gen.engine.step
    monkeypatch.setattr(Scheduler, "run", lambda self, streams: runs.append(len(streams))
                        or real_run(self, streams))
    monkeypatch.setattr(gen.engine, "step", lambda streams, budget=None: steps.append(
        (len(streams), budget)) or real_step(streams, budget))
    streams = generate_ids(gen, PROMPTS, greedy(5), "vanilla", 2)
    assert runs == [len(PROMPTS)]
    assert max(n for n, _ in steps) == 2 and {b for _, b in steps} == {None}
    assert [s.output_ids for s in streams] == [alone(tiny_spec_engine, p, 5) for p in PROMPTS]
    assert gen.cache.free_slots == 2
    with pytest.raises(ValueError, match="context"):  # the second prompt cannot be admitted
        generate_ids(gen, [[5, 6, 7], [5] * 5000], greedy(2))
    assert gen.cache.free_slots == 2  # the first one's slot is free again
