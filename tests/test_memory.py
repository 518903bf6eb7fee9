"""Memory stated before it is spent (runtime/memory.py): the plan's caches are the bytes the
runtime allocates (every KVCache of the target and the drafters, and the device loop's), its
weights the folder's files; a plan over the available memory is refused at load, by the
Generator, `LLM` and `serve`, with the numbers and the settings that fit (which then load);
`doctor` prints the table."""

import json
import re

import pytest
from click.testing import CliRunner

from trt_spec.cli import main
from trt_spec.runtime import memory
from trt_spec.runtime.config import ModelConfig
from trt_spec.runtime.generator import Generator
from trt_spec.runtime.kv_cache import KVCache
from trt_spec.runtime.memory import size
from trt_spec.runtime.sampling import SamplingParams
from trt_spec.runtime.settings import RuntimeConfig

MiB = 1 << 20


def allocated_caches(gen: Generator) -> list[KVCache]:
    """Every KVCache the generator holds: the target's and each loaded proposer's."""
    found = {id(gen.cache): gen.cache}
    for p in gen._proposers.values():
        for value in vars(p).values() if p is not None else ():
            for c in value if isinstance(value, list) else [value]:
                if isinstance(c, KVCache):
                    found[id(c)] = c
    return list(found.values())


def load_every_drafter(gen: Generator) -> None:
    for method in gen.drafters:
        gen.proposer(method)


@pytest.mark.parametrize("slots, max_len", [(1, 64), (3, 200)])
def test_the_plan_is_what_the_ort_runtime_allocates(tiny_vocab_engine, slots, max_len):
    gen = Generator(tiny_vocab_engine, max_batch=slots, max_len=max_len)
    load_every_drafter(gen)
    caches = allocated_caches(gen)
    # target, vanilla draft, 3 MTP modules, Eagle, Eagle3: one cache each
    assert len(caches) == len(gen.memory.rows) == 7
    assert sum(c.nbytes for c in caches) == gen.memory.cache_bytes
    assert gen.memory.slot_bytes * slots == gen.memory.cache_bytes
    # weights: every graph file of the target and the drafters, each once
    m = gen.manifest
    files = {f for name in ["target", *(g for e in gen.drafters.values() for g in e.all_graphs)]
             for f in m.graph(name)["files"]}
    assert gen.memory.weight_bytes == sum((m.folder / f).stat().st_size for f in files)


@pytest.mark.parametrize("method, dtype", [("eagle3", "float32"), ("mtp", "bfloat16"),
                                           ("vanilla", "float16")])
def test_the_plan_is_what_torch_and_its_device_loop_allocate(tiny_vocab_engine, method, dtype):
    """torch-cuda on the CPU: the host caches, the device loop's second set for the default
    method, and the weights counted from the configs equal the modules' parameters."""
    pytest.importorskip("torch")
    from trt_spec.runtime.device.loop import EXACT_ROWS

    assert memory.EXACT_ROWS == EXACT_ROWS  # (a copy: runtime/memory.py imports no torch)
    gen = Generator(tiny_vocab_engine, backend="torch-cuda", device="cpu", cuda_graphs=False,
                    dtype=dtype, method=method, num_draft_tokens=3, max_batch=2, max_len=50,
                    executor="device")
    load_every_drafter(gen)
    loop = gen.device_executor.loop(gen.stream([5, 6, 7], SamplingParams(max_tokens=4)))
    drafter = loop.drafter
    drafter_caches = [drafter.cache] if hasattr(drafter, "cache") else drafter.caches
    on_loop = sum(t.nbytes for c in [loop.cache, *drafter_caches] for t in c) \
        + loop.state.seq.nbytes
    assert sum(c.nbytes for c in allocated_caches(gen)) + on_loop == gen.memory.cache_bytes
    params = sum(p.numel() * p.element_size() for m in gen.graphs.modules.values()
                 for p in m.parameters())
    assert gen.memory.weights_estimated and gen.memory.weight_bytes == params


def fake_memory(monkeypatch, have: int) -> None:
    monkeypatch.setattr(memory, "host_available", lambda: have)


def test_a_plan_over_the_memory_is_refused_with_what_fits(tiny_vocab_engine, monkeypatch):
    have = 4 * MiB
    fake_memory(monkeypatch, have)
    with pytest.raises(ValueError) as e:
        Generator(tiny_vocab_engine, max_batch=8, max_len=256)
    text = str(e.value)
    plan = memory.memory_plan(_manifest(tiny_vocab_engine),
                              RuntimeConfig(max_batch=8, max_len=256),
                              _drafters(tiny_vocab_engine))
    budget = int(have * 0.9)
    assert plan.total > budget
    assert size(plan.total) in text and size(have) in text and "90%" in text
    assert "KV cache: target" in text and size(plan.slot_bytes) in text
    n = int(re.search(r"--max-model-len (\d+) at --max-num-seqs 8", text)[1])
    s = int(re.search(r"--max-num-seqs (\d+) at --max-model-len 256", text)[1])
    # the largest that fit: one more does not
    assert plan.at(max_len=n).total <= budget < plan.at(max_len=n + 1).total
    assert plan.at(slots=s).total <= budget < plan.at(slots=s + 1).total
    assert "int4" in text and "weights alone" not in text
    # and they load, under the same memory
    assert Generator(tiny_vocab_engine, max_batch=8, max_len=n).cache.max_len == n
    assert Generator(tiny_vocab_engine, max_batch=s, max_len=256).cache.slots == s
    # --memory-utilization past 1 takes it anyway
    assert Generator(tiny_vocab_engine, max_batch=8, max_len=256, memory_utilization=2.0)


def test_weights_that_do_not_fit_ask_for_a_smaller_export(tiny_vocab_engine, monkeypatch):
    fake_memory(monkeypatch, 1 * MiB)
    with pytest.raises(ValueError, match=r"weights alone \(1.7 MiB\) do not fit: an int4 "
                                         r"export") as e:
        Generator(tiny_vocab_engine, max_batch=1, max_len=16)
    fits = str(e.value).split("What would fit:")[1]
    assert "--max-model-len" not in fits and "--max-num-seqs" not in fits


def test_llm_refuses_with_the_same_message(tiny_vocab_engine, monkeypatch):
    from trt_spec import LLM

    fake_memory(monkeypatch, 4 * MiB)
    with pytest.raises(ValueError) as direct:
        Generator(tiny_vocab_engine, max_batch=8, max_len=256)
    with pytest.raises(ValueError) as api:
        LLM(tiny_vocab_engine, max_num_seqs=8, max_model_len=256)
    assert str(api.value) == str(direct.value)


def test_memory_utilization_is_checked():
    for bad in (0, -1, True, "0.9"):
        with pytest.raises(ValueError, match="memory_utilization"):
            RuntimeConfig(memory_utilization=bad)


def test_serve_refuses_at_start(tiny_vocab_engine):
    result = CliRunner().invoke(main, ["serve", "--engine", str(tiny_vocab_engine),
                                       "--memory-utilization", "0.0001", "--port", "0"])
    assert result.exit_code == 1, result.output
    assert "What would fit" in result.output and "--max-num-seqs" in result.output


def test_doctor_prints_the_table(tiny_vocab_engine):
    args = ["doctor", "--engine", str(tiny_vocab_engine), "--max-num-seqs", "2",
            "--max-model-len", "64"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    plan = memory.memory_plan(_manifest(tiny_vocab_engine),
                              RuntimeConfig(max_batch=2, max_len=64),
                              _drafters(tiny_vocab_engine))
    row = re.search(r"KV cache: target\s+(\S+ \S+)\s+(\S+ \S+)", result.output)
    assert row and row.groups() == (size(plan.rows[0].nbytes(1, 64)),
                                    size(plan.rows[0].nbytes(2, 64)))
    assert re.search(rf"total\s+{re.escape(size(plan.slot_bytes))}\s+"
                     rf"{re.escape(size(plan.total))} of the", result.output)
    report = json.loads(CliRunner().invoke(main, args + ["--json"]).output)
    assert report["engine"]["memory"]["total"] == plan.total
    assert report["engine"]["memory"]["fits"] is True


def test_an_8b_model_at_full_context_in_fp32():
    """Llama 3.1 8B's shape: 256 KiB a token in fp32, 32 GiB a slot at 131,072 tokens: on a
    48 GiB machine, beside its 30 GiB of fp32 weights, not one slot at its full context; 8
    slots of 9,258 rows."""
    llama = ModelConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                        num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128,
                        max_position_embeddings=131072, tie_word_embeddings=False)
    rows = memory.kv_rows("target", llama, 4)
    assert rows.row_bytes == 256 * 1024
    plan = memory.MemoryPlan({"target": memory.parameters(llama) * 4}, (rows,), 8, 131072,
                             131072, memory.HOST)
    assert memory.parameters(llama) == 8_030_261_248  # the published parameter count
    assert plan.slot_bytes == (131072 + 1) * 256 * 1024
    budget = 48 << 30
    n = plan.largest_max_len(budget)
    assert n == 9258 and plan.at(max_len=n).total <= budget < plan.at(max_len=n + 1).total
    assert plan.largest_slots(budget) is None  # not one slot at the full context
    assert any("--max-model-len" in f for f in memory.what_fits(plan, budget))


def _manifest(engine):
    from trt_spec.runtime.manifest import load_manifest

    return load_manifest(engine, verify="none")


def _drafters(engine):
    from trt_spec.runtime.generator import drafter_entries

    return drafter_entries(_manifest(engine))
