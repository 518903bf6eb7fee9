"""The CPU as ONNX Runtime's kernels see it: its name and the features MLAS dispatches on.

MLAS (ONNX Runtime's CPU kernels) picks its GEMM, quantized-GEMM and softmax kernels from
CPUID at start: AVX2/FMA, AVX-512 (F, BW, DQ, VL), VNNI (AVX-512 or VEX), AMX. Which of
them it picks decides which results a row gets, so the features are part of every
measurement's key (exactness probe, step costs). They are read here from CPUID itself, not
from /proc/cpuinfo: under `qemu-x86_64 -cpu max` (an AVX2 CPU emulated on any x86 host, the
tests' way to reach the AVX2 kernels) /proc/cpuinfo still lists the host's flags while
CPUID, which MLAS reads, does not. Elsewhere (not x86-64 Linux, or no executable memory)
/proc/cpuinfo's flags are used.
"""

from __future__ import annotations

import ctypes
import mmap
import platform
from functools import lru_cache
from pathlib import Path

# CPUID leaf 7 bits (subleaf 0: ebx, ecx, edx; subleaf 1: eax), from Intel's SDM vol. 2A
_LEAF7 = {
    "avx2": ("ebx", 5), "avx512f": ("ebx", 16), "avx512dq": ("ebx", 17),
    "avx512bw": ("ebx", 30), "avx512vl": ("ebx", 31), "avx512_vnni": ("ecx", 11),
    "amx_bf16": ("edx", 22), "amx_tile": ("edx", 24), "amx_int8": ("edx", 25),
}
_LEAF7_1 = {"avx_vnni": 4, "avx512_bf16": 5}  # eax of subleaf 1
# the features reported, in this order (x86; ARM's from /proc/cpuinfo)
FEATURES = ("avx", "fma", "avx2", "avx_vnni", "avx512f", "avx512bw", "avx512dq", "avx512vl",
            "avx512_vnni", "avx512_bf16", "amx_tile", "amx_int8", "amx_bf16",
            "asimd", "sve", "i8mm")

# cpuid(leaf edi, subleaf esi) -> 4 x uint32 at [rdx]: push rbx; mov eax, edi; mov ecx, esi;
# mov r8, rdx; cpuid; mov [r8], eax; mov [r8+4], ebx; mov [r8+8], ecx; mov [r8+12], edx;
# pop rbx; ret
_CPUID = bytes.fromhex("53 89f8 89f1 4989d0 0fa2 418900 41895804 41894808 4189500c 5b c3"
                       .replace(" ", ""))
# xgetbv(0) -> rax = edx:eax: xor ecx, ecx; xgetbv; shl rdx, 32; or rax, rdx; ret
_XGETBV = bytes.fromhex("31c9 0f01d0 48c1e220 4809d0 c3".replace(" ", ""))


class _Code:
    """Machine code in an executable page, callable through ctypes."""

    def __init__(self, code: bytes, restype, *argtypes):
        self.page = mmap.mmap(-1, mmap.PAGESIZE, prot=mmap.PROT_READ | mmap.PROT_WRITE
                              | mmap.PROT_EXEC)
        self.page.write(code)
        address = ctypes.addressof(ctypes.c_char.from_buffer(self.page))
        self.fn = ctypes.CFUNCTYPE(restype, *argtypes)(address)


def _cpuid_features() -> set[str]:
    cpuid = _Code(_CPUID, None, ctypes.c_uint32, ctypes.c_uint32, ctypes.c_void_p)
    out = (ctypes.c_uint32 * 4)()

    def regs(leaf: int, sub: int = 0) -> dict[str, int]:
        cpuid.fn(leaf, sub, ctypes.addressof(out))
        return dict(zip(("eax", "ebx", "ecx", "edx"), out))

    top = regs(0)["eax"]
    one = regs(1)
    found = set()
    osxsave = one["ecx"] >> 27 & 1
    xgetbv = _Code(_XGETBV, ctypes.c_uint64)  # held while called: its page is the code
    xcr0 = xgetbv.fn() if osxsave else 0
    ymm = xcr0 & 0x6 == 0x6  # the OS saves SSE and AVX state
    zmm = ymm and xcr0 & 0xE0 == 0xE0  # ... and AVX-512's opmask and upper registers
    tiles = xcr0 & 0x60000 == 0x60000  # ... and AMX's tile config and data
    if ymm and one["ecx"] >> 28 & 1:
        found.add("avx")
    if ymm and one["ecx"] >> 12 & 1:
        found.add("fma")
    if top >= 7:
        seven = regs(7)
        seven_one = regs(7, 1)
        for name, (reg, bit) in _LEAF7.items():
            usable = tiles if name.startswith("amx") else zmm if "512" in name else ymm
            if usable and seven[reg] >> bit & 1:
                found.add(name)
        for name, bit in _LEAF7_1.items():
            usable = zmm if "512" in name else ymm
            if usable and seven_one["eax"] >> bit & 1:
                found.add(name)
    return found


def _proc_features() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    flags: set[str] = set()
    for line in text.splitlines():
        if line.startswith(("flags", "Features")):
            flags |= set(line.split(":", 1)[1].split())
    return flags


@lru_cache(maxsize=1)
def cpu_flags() -> tuple[str, ...]:
    """The features of FEATURES this CPU has and the OS enables, as CPUID reports them."""
    found = None
    if platform.machine() in ("x86_64", "AMD64") and platform.system() == "Linux":
        try:
            found = _cpuid_features()
        except (OSError, ValueError, AttributeError):
            found = None  # no executable page (a hardened kernel): /proc/cpuinfo's word
    if found is None:
        found = _proc_features()
    return tuple(f for f in FEATURES if f in found)


def cpu_kind(flags: tuple[str, ...] | None = None) -> str:
    """A short name for the kernel family MLAS can pick: amx, avx512-vnni, avx512, avx2-vnni,
    avx2, or the machine's architecture."""
    flags = cpu_flags() if flags is None else flags
    for kind, needs in (("amx", "amx_int8"), ("avx512-vnni", "avx512_vnni"),
                        ("avx512", "avx512bw"), ("avx2-vnni", "avx_vnni"), ("avx2", "avx2"),
                        ("neon", "asimd")):
        if needs in flags:
            return kind
    return platform.machine() or "unknown"


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()
