"""Prefix caching on tiny engines: a prompt that starts with a kept slot's tokens reads only
the rest, and its output is the output without the cache, for every method; the edge cases
(an exact prefix, concurrent requests sharing one kept prefix, stop strings, seeds, eviction,
other engines, tools that allocate slots themselves)."""

import numpy as np
import pytest

from trt_spec.runtime.generator import Generator
from trt_spec.runtime.kv_cache import KVCache
from trt_spec.runtime.methods import Speculation
from trt_spec.runtime.prefix_cache import MIN_TOKENS, PrefixCache, common_prefix
from trt_spec.runtime.sampling import SamplingParams
from trt_spec.runtime.scheduler import Scheduler
from trt_spec.runtime.scheduler import generate_ids

RNG = np.random.default_rng(7)
TURN1 = RNG.integers(3, 128, 40).tolist()
USER2 = RNG.integers(3, 128, 9).tolist()
OTHER = RNG.integers(3, 128, 30).tolist()  # shares nothing with TURN1 (long enough to matter)
GREEDY = SamplingParams(max_tokens=10, ignore_eos=True)
METHODS = [("tiny_spec_engine", ["none", "vanilla", "ngram", "suffix", "hybrid"]),
           ("tiny_heads_engine", ["mtp", "eagle", "eagle3", "hybrid"])]


def run(sched: Scheduler, prompts, params=GREEDY, method=None, k=None):
    """Submits the prompts together and steps until all are done."""
    reqs = [sched.submit(p, params, Speculation(method, k)) for p in prompts]
    while not all(r.done for r in reqs):
        sched.step()
    return reqs


def conversation(sched: Scheduler, method: str, params=GREEDY):
    """Turn 1 beside an unrelated request (so the kept slot sits idle inside later steps'
    slot range), then turn 2 = turn 1 + its answer + a new message, beside another one."""
    first, _ = run(sched, [TURN1, OTHER], params, method)
    turn2 = TURN1 + first.stream.output_ids + USER2
    second, other = run(sched, [turn2, OTHER[:12] + USER2], params, method)
    return first, second, other


@pytest.mark.parametrize("engine, methods", METHODS)
def test_a_hit_reads_only_the_new_tokens_and_changes_no_token(engine, methods, request):
    folder = request.getfixturevalue(engine)
    cached = Generator(folder, max_batch=3, max_len=128, num_draft_tokens=3)
    plain = Generator(folder, max_batch=3, max_len=128, num_draft_tokens=3, prefix_cache=False)
    for method in methods:
        cached.cache.forget()
        with_cache = conversation(Scheduler(cached), method)
        without = conversation(Scheduler(plain), method)
        for a, b in zip(with_cache, without):
            assert a.stream.output_ids == b.stream.output_ids, method
        first, second, _ = with_cache
        # turn 2's KV up to the end of turn 1's answer (its last token has no row yet)
        shared = len(TURN1) + len(first.stream.output_ids) - 1
        # a head re-reads at most the shared rows of turn 1's last step (k + 1 = 4 rows)
        assert shared - 4 <= second.stream.stats.cached_tokens <= shared, method
        assert second.stream.metrics().cached_tokens == second.stream.stats.cached_tokens
        assert second.stream.prefill_pos == len(second.stream.prompt_ids)
        assert all(r.stream.stats.cached_tokens == 0 for r in without)
    if engine == "tiny_heads_engine":  # the heads followed the kept rows: they drafted
        assert second.stream.stats.proposed > 0


@pytest.mark.parametrize("engine, methods", METHODS)
def test_heads_start_a_few_rows_before_the_shared_prefix_ends(engine, methods, request):
    gen = Generator(request.getfixturevalue(engine), max_batch=2, max_len=128,
                    num_draft_tokens=3)
    sched = Scheduler(gen)
    for method in methods:
        gen.cache.forget()
        first, = run(sched, [TURN1], method=method)
        turn2 = TURN1 + first.stream.output_ids + USER2
        second, = run(sched, [turn2], method=method)
        shared = len(TURN1) + len(first.stream.output_ids) - 1
        p = gen.proposer(method)
        reads = p is not None and p.reads is not None
        hit = second.stream.stats.cached_tokens
        # a head re-reads at most the shared rows of turn 1's last step (k + 1 = 4 rows)
        assert (shared - 4 <= hit <= shared) if reads else hit == shared, (method, hit, shared)


def test_an_exact_prefix_of_a_kept_prompt_reads_its_last_token(tiny_spec_engine):
    gen = Generator(tiny_spec_engine, max_batch=2, max_len=128)
    sched = Scheduler(gen)
    run(sched, [TURN1])
    for prompt in (TURN1, TURN1[:20]):  # the same prompt, and a prefix of it
        r, = run(sched, [prompt])
        assert r.stream.stats.cached_tokens == len(prompt) - 1
        want = generate_ids(Generator(tiny_spec_engine, prefix_cache=False), [prompt], GREEDY)
        assert r.stream.output_ids == want[0].output_ids


def test_concurrent_requests_sharing_a_kept_prefix_each_get_its_rows(tiny_heads_engine):
    gen = Generator(tiny_heads_engine, max_batch=3, max_len=128, num_draft_tokens=2)
    sched = Scheduler(gen)
    first, = run(sched, [TURN1], method="eagle3")
    base = TURN1 + first.stream.output_ids
    follow = [base + USER2, base + USER2[:4], base + OTHER[:6]]
    reqs = run(sched, follow, method="eagle3")  # admitted in one step: one kept slot
    plain = Generator(tiny_heads_engine, max_batch=3, max_len=128, num_draft_tokens=2,
                      prefix_cache=False)
    want = generate_ids(plain, follow, GREEDY, "eagle3")
    assert [r.stream.output_ids for r in reqs] == [s.output_ids for s in want]
    hits = [r.stream.stats.cached_tokens for r in reqs]
    assert min(hits) >= len(base) - 5  # none of them read the shared history again
    assert gen.prefix_cache.stats.copied_rows > 0  # two of them from the first one's slot
    assert len({r.stream.slot for r in reqs}) == 1  # all released: slots are None
    assert gen.cache.free_slots == 3


def test_sampling_settings_and_seeds_may_differ_between_turns(tiny_spec_engine):
    cached = Scheduler(Generator(tiny_spec_engine, max_batch=2, max_len=128))
    plain = Scheduler(Generator(tiny_spec_engine, max_batch=2, max_len=128, prefix_cache=False))
    turn1 = SamplingParams(max_tokens=8, temperature=0.9, seed=3, ignore_eos=True)
    first, = run(cached, [TURN1], turn1, "ngram", 2)
    turn2 = TURN1 + first.stream.output_ids + USER2
    for params in (SamplingParams(max_tokens=8, temperature=0.7, top_p=0.9, seed=11,
                                  ignore_eos=True), GREEDY):
        a, = run(cached, [turn2], params, "ngram", 2)
        b, = run(plain, [turn2], params, "ngram", 2)
        assert a.stream.stats.cached_tokens > 0
        assert a.stream.output_ids == b.stream.output_ids


def test_a_stop_string_inside_the_shared_prefix_does_not_stop_the_answer(tiny_spec_engine):
    gen = Generator(tiny_spec_engine, max_batch=1, max_len=128)
    tok = gen.tokenizer
    first, = run(Scheduler(gen), [TURN1])
    turn2 = TURN1 + first.stream.output_ids + USER2
    stop = tok.decode(first.stream.output_ids[2:5])  # text inside the kept history
    params = SamplingParams(max_tokens=10, ignore_eos=True, stop=[stop])
    a, = run(Scheduler(gen), [turn2], params)
    b, = run(Scheduler(Generator(tiny_spec_engine, max_len=128, prefix_cache=False)), [turn2],
             params)
    assert a.stream.stats.cached_tokens > 0
    assert (a.stream.output_ids, a.stream.text, a.stream.finish_reason) == (
        b.stream.output_ids, b.stream.text, b.stream.finish_reason)


def test_slots_are_evicted_least_recently_kept_first(tiny_engine):
    gen = Generator(tiny_engine, max_batch=2, max_len=128)
    sched = Scheduler(gen)
    a, b, c = (RNG.integers(3, 128, 24).tolist() for _ in range(3))
    run(sched, [a])
    run(sched, [b])
    assert len(gen.cache.kept) == 2
    r, = run(sched, [c])  # no empty slot: a's (the least recently kept) goes
    assert r.stream.stats.cached_tokens == 0
    assert [common_prefix(k.tokens, b) for k in gen.cache.kept.values()][0] == len(b)
    r, = run(sched, [b + [5, 6]])
    assert r.stream.stats.cached_tokens == len(b)
    r, = run(sched, [a + [5, 6]])
    assert r.stream.stats.cached_tokens == 0
    stats = gen.prefix_cache.stats
    assert (stats.lookups, stats.hits) == (5, 1) and stats.hit_rate == pytest.approx(0.2)


def test_short_shared_prefixes_are_read_again(tiny_engine):
    gen = Generator(tiny_engine, max_batch=2, max_len=128)
    sched = Scheduler(gen)
    run(sched, [TURN1])
    r, = run(sched, [TURN1[:MIN_TOKENS - 1] + OTHER])
    assert r.stream.stats.cached_tokens == 0
    r, = run(sched, [TURN1[:MIN_TOKENS] + OTHER])
    assert r.stream.stats.cached_tokens == MIN_TOKENS


def test_nothing_kept_crosses_engines_or_survives_being_turned_off(tiny_engine, tiny_spec_engine):
    one = Generator(tiny_engine, max_batch=1, max_len=128)
    other = Generator(tiny_spec_engine, max_batch=1, max_len=128)
    run(Scheduler(one), [TURN1])
    r, = run(Scheduler(other), [TURN1 + USER2])
    assert r.stream.stats.cached_tokens == 0  # its own cache: empty
    assert one.cache.kept and one.cache.kept is not other.cache.kept
    one.configure(prefix_cache=False)
    assert not one.cache.kept and one.prefix_cache is None
    r, = run(Scheduler(one), [TURN1 + USER2])
    assert r.stream.stats.cached_tokens == 0 and not one.cache.kept
    one.configure(prefix_cache=True)
    run(Scheduler(one), [TURN1])
    r, = run(Scheduler(one), [TURN1 + USER2])
    assert r.stream.stats.cached_tokens == len(TURN1)


def test_a_slot_allocated_outside_the_engine_keeps_nothing(tiny_engine):
    # tools (fidelity, step costs) take a slot from the cache directly and write into it
    gen = Generator(tiny_engine, max_batch=1, max_len=128)
    run(Scheduler(gen), [TURN1])
    slot = gen.cache.allocate()
    assert not gen.cache.kept
    gen.cache.release(slot)
    r, = run(Scheduler(gen), [TURN1 + USER2])
    assert r.stream.stats.cached_tokens == 0


def test_the_kv_cache_keeps_copies_and_evicts(tiny_engine):
    gen = Generator(tiny_engine, max_batch=3, max_len=16)
    cache: KVCache = gen.cache
    a = cache.allocate()
    for i, b in enumerate(cache.buffers):
        b[a] = i + 1
    cache.release(a, [1, 2, 3], owner=9)
    assert list(cache.kept) == [a] and cache.kept[a].owner == 9
    b = cache.allocate()
    assert b != a and a in cache.kept  # an empty slot first
    cache.copy_rows(a, b, 2)
    assert all((buf[b, :, :2] == i + 1).all() and (buf[b, :, 2:] == 0).all()
               for i, buf in enumerate(cache.buffers))
    c = cache.allocate()
    d = PrefixCache(cache).take(None)  # no empty slot left: the kept one is evicted
    assert d == a and not cache.kept and {a, b, c} == {0, 1, 2}
    with pytest.raises(ValueError, match="min_tokens"):
        PrefixCache(cache, min_tokens=0)


def torch_gen(folder, **options):
    from trt_spec.export.torch_backend import TorchGraphs
    from trt_spec.runtime.manifest import load_manifest

    manifest = load_manifest(folder)
    graphs = TorchGraphs.from_manifest(manifest, device="cpu", cuda_graphs=False)
    return Generator.from_graphs(manifest, graphs, **{"max_batch": 3, "max_len": 128,
                                                      "num_draft_tokens": 3, **options})


def test_the_torch_host_loop_reuses_slots_and_the_device_loop_its_own(tiny_heads_engine):
    host = torch_gen(tiny_heads_engine, executor="host")
    plain = torch_gen(tiny_heads_engine, executor="host", prefix_cache=False)
    for method in ("none", "eagle3"):
        host.cache.forget()
        a = conversation(Scheduler(host), method)
        b = conversation(Scheduler(plain), method)
        assert [r.stream.output_ids for r in a] == [r.stream.output_ids for r in b], method
        assert a[1].stream.stats.cached_tokens > len(TURN1)
    # the device executor keeps rows in its loop's own caches (runtime/device/prefill.py): a
    # repeated prompt starts from them; the host's kept slots stay empty
    device = torch_gen(tiny_heads_engine, executor="device")
    a, b = (generate_ids(device, [TURN1], GREEDY, "eagle3", 3)[0] for _ in range(2))
    assert (a.stats.cached_tokens, b.stats.cached_tokens) == (0, len(TURN1) - 1)
    assert a.output_ids == b.output_ids and a.executor == "device" and not device.cache.kept


def test_the_python_api_takes_the_switch(tiny_spec_engine):
    from trt_spec import LLM

    chat = [{"role": "user", "content": "a b c d e f g h i j"}]
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    on = LLM(tiny_spec_engine, max_num_seqs=2, max_model_len=128)
    first = on.generate(chat, params)[0]
    turn2 = chat + [{"role": "assistant", "content": first.text},
                    {"role": "user", "content": "k l m"}]
    hit = on.generate(turn2, params)[0]
    assert hit.metrics.cached_tokens >= len(first.prompt_token_ids)
    off = LLM(tiny_spec_engine, max_num_seqs=2, max_model_len=128, prefix_cache=False)
    off.generate(chat, params)
    miss = off.generate(turn2, params)[0]
    assert miss.metrics.cached_tokens == 0 and miss.token_ids == hit.token_ids
    with pytest.raises(ValueError, match="prefix_cache"):
        LLM(tiny_spec_engine, prefix_cache="yes")


def test_a_request_that_failed_keeps_nothing(tiny_engine, monkeypatch):
    gen = Generator(tiny_engine, max_batch=1, max_len=128)
    sched = Scheduler(gen)

    def broken(streams, m):
        raise RuntimeError("a backend failed mid-step")

    monkeypatch.setattr(gen.engine, "decode", broken)
    r, = run(sched, [TURN1])
    assert r.stream.finish_reason == "error" and not gen.cache.kept
    monkeypatch.undo()
    r, = run(sched, [TURN1 + USER2])
    assert r.stream.stats.cached_tokens == 0 and r.stream.finish_reason == "length"


def test_a_hit_left_before_its_prefill_can_be_hit_again(tiny_heads_engine):
    # turn 2 starts from turn 1's rows and is cancelled before any step: its head never saw a
    # target row; turn 2 asked again starts from the same rows, and its output is unchanged
    gen = Generator(tiny_heads_engine, max_batch=1, max_len=128, num_draft_tokens=3)
    sched = Scheduler(gen)
    first, = run(sched, [TURN1], method="eagle3")
    turn2 = TURN1 + first.stream.output_ids + USER2
    left = gen.stream(turn2, GREEDY, Speculation("eagle3"))
    gen.engine.admit(left)  # admitted, then cancelled before the step that would prefill it
    gen.engine.release(left)
    assert left.stats.cached_tokens > len(TURN1) and gen.cache.kept
    again, = run(sched, [turn2], method="eagle3")
    assert again.stream.stats.cached_tokens > len(TURN1)
    plain = Generator(tiny_heads_engine, max_len=128, num_draft_tokens=3, prefix_cache=False)
    assert again.stream.output_ids == generate_ids(plain, [turn2], GREEDY, "eagle3")[0].output_ids
    # a short shared prefix, before the head's kept target rows: its rows are read again
    short = TURN1[:20] + USER2
    left = gen.stream(short, GREEDY, Speculation("eagle3"))
    gen.engine.admit(left)
    gen.engine.release(left)
    again, = run(sched, [short], method="eagle3")
    assert again.stream.stats.cached_tokens > 0
    assert again.stream.output_ids == generate_ids(plain, [short], GREEDY, "eagle3")[0].output_ids


def test_a_long_chat_keeps_its_history_beside_short_requests(tiny_heads_engine):
    """Three turns of a chat whose first turn is longer than a prefill chunk (one turn ended
    by length, one by a stop token, method auto with heads) each read only their new tokens;
    then four short requests that share only its first tokens (a system prompt) leave its
    record alone while free slots exist, and the same chat again reads only its new tokens."""
    gen = Generator(tiny_heads_engine, max_batch=4, max_len=200, method="auto",
                    num_draft_tokens=3, max_prefill_tokens=16)
    sched = Scheduler(gen)
    system = TURN1[:10]
    first_turn = TURN1 + OTHER  # 70 tokens: read in 5 chunks
    by_length = SamplingParams(max_tokens=6, ignore_eos=True)
    dry = Scheduler(Generator(tiny_heads_engine, max_batch=1, max_len=200, prefix_cache=False))
    one, = run(dry, [first_turn], by_length)
    two, = run(dry, [first_turn + one.stream.output_ids + USER2],
               SamplingParams(max_tokens=8, ignore_eos=True))
    stop = two.stream.output_ids[3]  # turn 2 ends on this token, as on an end of turn
    ends = [by_length, SamplingParams(max_tokens=8, ignore_eos=True, stop_token_ids=(stop,)),
            by_length]
    k = 3

    def chat():
        prompt, previous, got = first_turn, None, []
        for params in ends:
            r, = run(sched, [prompt], params)
            got.append(r)
            if previous is not None:  # the new tokens: past the common prefix with the
                new = len(prompt) - common_prefix(previous, prompt)  # last turn's ids
                assert r.stream.stats.cached_tokens >= len(prompt) - (new + k + 1), (
                    len(prompt), new, r.stream.stats.cached_tokens)
            previous = r.stream.prompt_ids + r.stream.output_ids
            prompt = previous + USER2
        return got

    turns = chat()
    assert [t.stream.finish_reason for t in turns] == ["length", "stop", "length"]
    for short in range(4):
        r, = run(sched, [system + [3 + short, 7, 9]], SamplingParams(max_tokens=3))
        assert r.stream.stats.cached_tokens >= MIN_TOKENS  # the system prompt is a hit ...
    again = chat()  # ... that did not destroy the chat's record
    assert again[0].stream.stats.cached_tokens == len(first_turn) - 1
    assert [t.stream.output_ids for t in again] == [t.stream.output_ids for t in turns]


def test_eviction_prefers_the_record_whose_loss_costs_least(tiny_engine):
    """With no empty slot, the record whose tokens no other record holds is the fewest goes,
    even when it is not the least recently kept."""
    gen = Generator(tiny_engine, max_batch=2, max_len=128)
    sched = Scheduler(gen)
    long, short = RNG.integers(3, 128, 60).tolist(), RNG.integers(3, 128, 12).tolist()
    run(sched, [long])  # kept first: least recently
    run(sched, [short])
    run(sched, [OTHER])  # needs a slot: the short record costs 12 + 10 tokens, the long 70
    kept = [len(k.tokens) for k in gen.cache.kept.values()]
    assert len(long) + 9 in kept and len(short) + 9 not in kept, kept
    r, = run(sched, [long + [5, 6]])
    assert r.stream.stats.cached_tokens == len(long)
