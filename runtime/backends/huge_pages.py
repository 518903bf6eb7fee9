"""A session's weights on 2 MiB pages (Linux transparent huge pages), for a faster CPU step.

A plain decoding step on a CPU streams every weight once: ~120 MiB of prepacked int4 products
and tables for SmolLM2-135M, which ONNX Runtime allocates through malloc on 4 KiB pages. Each
page costs a TLB miss and a page walk, every step. Measured on a 2-vCPU Xeon (AVX-512, AMX;
docs/quantization.md, "The lean graph"): one graph's step took 13.1-14.5 CPU ms at one thread
on 4 KiB pages, depending on where its session's memory landed (the session made first the
slowest), and 11.4-11.8 on 2 MiB pages, alike for every session.

The machine's default (`/sys/kernel/mm/transparent_hugepage/enabled` = madvise) gives huge
pages only to memory that asks for them. So a session is made inside `huge_pages()`: the
process's writable anonymous mappings (and the heap) are listed before and after, and what the
session added (new ranges, and mappings it refilled with a huge page or more) is marked
MADV_HUGEPAGE and collapsed into huge pages at once (MADV_COLLAPSE, Linux 6.1+). Nothing else of the process is touched, the contents stay the same (the outputs
are bitwise those without it), and the cost is the collapse's copy at load (a SmolLM2-135M
generator, drafters included, loaded in 2.8 s against 2.0, its RSS the same 255 MB). Where the kernel lacks it, or
TRT_SPEC_HUGE_PAGES=0, nothing is done and the load reports 0 bytes.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys
from contextlib import contextmanager

HUGE = 2 << 20  # bytes in an x86-64 / arm64 (4 KiB granule) huge page
MADV_HUGEPAGE, MADV_COLLAPSE = 14, 25  # <linux/mman.h>

MIN_BYTES = 16 << 20  # a graph's files below this stay on 4 KiB pages (worth < a few TLB misses)

Range = tuple[int, int]  # [lo, hi) virtual addresses


def enabled() -> bool:
    """Linux, and not switched off by TRT_SPEC_HUGE_PAGES=0."""
    return sys.platform.startswith("linux") and os.environ.get("TRT_SPEC_HUGE_PAGES", "1") != "0"


def worth_it(graph_bytes: int) -> bool:
    """Whether a graph of `graph_bytes` (its files, external data included) gets huge pages:
    listing the mappings costs ~10-20 ms a session, which a tiny graph cannot win back."""
    return enabled() and graph_bytes >= MIN_BYTES


def writable_anonymous(smaps: str = "/proc/self/smaps") -> dict[Range, int]:
    """The process's writable private mappings that no file backs (malloc's mmaps, the heap)
    -> their resident anonymous bytes."""
    out: dict[Range, int] = {}
    current = None
    with open(smaps) as f:
        for line in f:
            fields = line.split()
            if "-" in fields[0] and not fields[0].endswith(":"):  # a mapping's header line
                anonymous = len(fields) == 5 or fields[5] == "[heap]"
                current = (tuple(int(x, 16) for x in fields[0].split("-"))
                           if fields[1] == "rw-p" and anonymous else None)
            elif current is not None and fields[0] == "Anonymous:":
                out[current] = int(fields[1]) * 1024
    return out


def added(before: list[Range], after: list[Range]) -> list[Range]:
    """The parts of `after` that no range of `before` covers (what an allocation added,
    new mappings and grown ones)."""
    out = []
    for lo, hi in after:
        pieces = [(lo, hi)]
        for blo, bhi in before:
            pieces = [p for a, b in pieces for p in
                      ([(a, b)] if bhi <= a or blo >= b else
                       [q for q in ((a, blo), (bhi, b)) if q[0] < q[1]])]
        out += pieces
    return out


def grown(before: dict[Range, int], after: dict[Range, int]) -> list[Range]:
    """What a session's allocations went into: the address ranges it added, and whole
    mappings that were there before and now hold at least a huge page more resident memory
    (freed memory malloc gave it again, as the heap's)."""
    resident = {lo: anon for (lo, _), anon in before.items()}
    refilled = [(lo, hi) for (lo, hi), anon in after.items()
                if lo in resident and anon - resident[lo] >= HUGE]
    return refilled + [r for r in added(list(before), list(after))
                       if not any(lo <= r[0] and r[1] <= hi for lo, hi in refilled)]


def collapse(ranges: list[Range]) -> int:
    """Each range's whole huge pages marked MADV_HUGEPAGE and collapsed now -> bytes now on
    huge pages (0 where the kernel refuses: before Linux 6.1, or THP disabled)."""
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    done = 0
    for lo, hi in ranges:
        a, b = -(-lo // HUGE) * HUGE, hi // HUGE * HUGE  # the huge pages inside [lo, hi)
        if b <= a:
            continue
        libc.madvise(a, b - a, MADV_HUGEPAGE)  # later faults in the range get huge pages too
        if libc.madvise(a, b - a, MADV_COLLAPSE) == 0:
            done += b - a
    return done


@contextmanager
def huge_pages(wanted: bool = True):
    """Memory allocated inside the block goes onto huge pages at its end; yields a list that
    then holds the bytes collapsed (module docstring). wanted False: nothing is done."""
    report = [0]
    if not (wanted and enabled()):
        yield report
        return
    try:
        before = writable_anonymous()
    except OSError:  # no /proc/self/smaps (a sandbox, an emulator): 4 KiB pages, as ever
        yield report
        return
    yield report
    try:
        report[0] = collapse(grown(before, writable_anonymous()))
    except OSError:  # what was made stays as made; only its pages are left as they are
        pass
