"""A session's memory on huge pages (runtime/backends/huge_pages.py): only what the session
added is collapsed, and its outputs are bitwise those on 4 KiB pages."""

import ctypes
import mmap
import sys
from pathlib import Path

import numpy as np
import pytest

from trt_spec.runtime.backends import huge_pages as hp

linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux THP only")
THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


@pytest.mark.parametrize("before,after,want", [
    ([], [(0, 10)], [(0, 10)]),
    ([(0, 10)], [(0, 10)], []),
    ([(0, 10)], [(0, 30)], [(10, 30)]),  # a mapping that grew: only the growth
    ([(10, 20)], [(0, 30)], [(0, 10), (20, 30)]),
    ([(0, 5), (25, 40)], [(0, 30), (50, 60)], [(5, 25), (50, 60)]),
])
def test_added_is_what_no_earlier_range_covers(before, after, want):
    assert hp.added(before, after) == want


def huge_kib(lo: int, hi: int) -> int:
    """AnonHugePages (KiB) of the mappings inside [lo, hi)."""
    total, inside = 0, False
    for line in open("/proc/self/smaps"):
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            a, b = (int(x, 16) for x in head.split("-"))
            inside = a < hi and b > lo
        elif inside and head == "AnonHugePages:":
            total += int(line.split()[1])
    return total


@linux
def test_memory_allocated_inside_goes_onto_huge_pages(monkeypatch):
    if not THP.exists() or "[never]" in THP.read_text():
        pytest.skip(f"transparent huge pages off here ({THP})")
    monkeypatch.delenv("TRT_SPEC_HUGE_PAGES", raising=False)
    size = 16 << 20
    with hp.huge_pages() as collapsed:
        block = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)  # as malloc
        block.write(b"\1" * size)  # touched: on 4 KiB pages now
    if collapsed[0] == 0:
        pytest.skip("the kernel refused MADV_COLLAPSE (before Linux 6.1?)")
    lo = ctypes.addressof(ctypes.c_char.from_buffer(block))
    assert collapsed[0] >= size - 2 * hp.HUGE
    assert huge_kib(lo, lo + size) * 1024 >= size - 2 * hp.HUGE
    assert block[:4] == b"\1\1\1\1" and block[size - 1] == 1  # contents kept


def test_switched_off_by_the_environment_or_for_a_small_graph(monkeypatch):
    monkeypatch.setenv("TRT_SPEC_HUGE_PAGES", "0")
    with hp.huge_pages() as collapsed:
        block = bytearray(8 << 20)
    assert collapsed == [0] and len(block) == 8 << 20
    assert not hp.worth_it(1 << 30)
    monkeypatch.delenv("TRT_SPEC_HUGE_PAGES")
    assert not hp.worth_it(hp.MIN_BYTES - 1) and hp.worth_it(hp.MIN_BYTES) == hp.enabled()
    with hp.huge_pages(wanted=False) as collapsed:
        block = bytearray(8 << 20)
    assert collapsed == [0]


def test_a_target_on_huge_pages_gives_bitwise_the_same_steps(tiny_engine_int4,
                                                             monkeypatch):
    """The same graph loaded with and without the collapse: bitwise the same logits and
    rows over prefill, decode and a verification step."""
    from trt_spec.runtime.backends.ort import OrtTarget
    from trt_spec.runtime.kv_cache import KVCache
    from trt_spec.runtime.manifest import load_manifest
    from trt_spec.runtime.step_inputs import SlotTokens

    config = load_manifest(tiny_engine_int4).config
    path = tiny_engine_int4 / "target.onnx"

    monkeypatch.setattr(hp, "MIN_BYTES", 0)  # the tiny graph too

    def steps(huge: str):
        monkeypatch.setenv("TRT_SPEC_HUGE_PAGES", huge)
        target = OrtTarget(path, config.num_layers, config.max_position_embeddings, threads=1)
        cache = KVCache(config, slots=1, max_len=32)
        slot = cache.allocate()
        out = [target.step(cache, [SlotTokens(slot, [5, 17, 99, 3], [3])])]
        out += [target.step(cache, [SlotTokens(slot, [t], [0])]) for t in (42, 8)]
        out.append(target.step(cache, [SlotTokens(slot, [77, 61, 23], [0, 1, 2])]))
        return [x for s in out for x in [*s.logits, *s.rows.values()]]

    for got, want in zip(steps("1"), steps("0"), strict=True):
        np.testing.assert_array_equal(got, want)


def test_grown_takes_new_ranges_and_refilled_mappings():
    mb = 1 << 20
    before = {(0, 64 * mb): 4 * mb, (100 * mb, 110 * mb): 1 * mb}
    after = {(0, 64 * mb): 40 * mb,  # freed memory given out again: the whole mapping
             (100 * mb, 120 * mb): 2 * mb,  # grew by 10 MiB, 1 MiB more resident: the growth
             (200 * mb, 210 * mb): 10 * mb}  # new
    assert hp.grown(before, after) == [(0, 64 * mb), (110 * mb, 120 * mb), (200 * mb, 210 * mb)]


def test_a_process_without_smaps_loads_on_small_pages(monkeypatch):
    """Where /proc/self/smaps cannot be read (a sandbox, an emulator), what the block makes is
    made all the same and nothing is collapsed."""
    monkeypatch.setattr(hp, "enabled", lambda: True)

    def unreadable(smaps="/proc/self/smaps"):
        raise FileNotFoundError(smaps)

    monkeypatch.setattr(hp, "writable_anonymous", unreadable)
    with hp.huge_pages() as collapsed:
        block = bytearray(8 << 20)
    assert collapsed == [0] and len(block) == 8 << 20
