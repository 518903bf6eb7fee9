"""The exactness tests again on ONNX Runtime's AVX2 kernels, from any x86-64 machine.

MLAS picks its kernels from CPUID, and the machines this suite runs on are drawn by chance:
an AVX-512/AMX host never takes the AVX2 paths (where a 1-row int4 product rounds apart
and the u8 x s8 integer GEMM saturates: docs/speculative-decoding.md). Debian's qemu-user
(QEMU 7.2's TCG emulates AVX2 but not AVX-512) runs this suite's Python under `-cpu max`, so
CPUID there reports an AVX2-only CPU; the tiny-model exactness tests then run under it in a
subprocess, one ORT thread (qemu-user is slow, 10-20x; threads add nothing there).

Skipped where qemu-x86_64 is absent (`apt-get install qemu-user`; .ci/run installs it), off
x86-64, and on an AVX2-only host, where those tests already ran natively.
"""

import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from trt_spec.runtime.backends.cpu import cpu_kind

ROOT = Path(__file__).resolve().parents[1]
QEMU = shutil.which("qemu-x86_64")
# tiny-model tests whose claim depends on the kernels: bitwise row independence, lossless
# speculation, the integer GEMM of int8-rows
EXACTNESS_TESTS = [
    "tests/test_ort_target.py",
    "tests/test_exact_rows.py",
    "tests/test_int8_rows.py",
    "tests/test_quantize.py::test_forms_through_onnx_runtime",
    "tests/test_speculative.py::test_greedy_speculative_equals_plain",
    "tests/test_engine.py::test_batched_streams_equal_one_at_a_time",
]

needs_qemu = pytest.mark.skipif(
    QEMU is None or platform.machine() != "x86_64",
    reason="needs qemu-user's qemu-x86_64 on an x86-64 host to emulate an AVX2-only CPU "
           "(apt-get install qemu-user)")


def emulated(*args: str, timeout: int) -> subprocess.CompletedProcess:
    env = {**os.environ, "TRT_SPEC_THREADS": "1", "PYTHONPATH": str(ROOT)}
    return subprocess.run([QEMU, "-cpu", "max", sys.executable, *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


@needs_qemu
def test_emulated_cpu_is_avx2_only():
    """CPUID under the emulator: AVX2 and FMA, no AVX-512, no VNNI, no AMX."""
    out = emulated("-c", "from trt_spec.runtime.backends.cpu import cpu_flags, cpu_kind; "
                   "print(cpu_kind(), *cpu_flags())", timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    kind, *flags = out.stdout.split()
    assert kind == "avx2" and "fma" in flags
    assert not any(f.startswith(("avx512", "amx")) or "vnni" in f for f in flags), flags


@needs_qemu
@pytest.mark.skipif(cpu_kind() == "avx2", reason="this CPU is AVX2-only: the exactness tests "
                    "ran natively on its AVX2 kernels")
def test_exactness_tests_pass_on_avx2_kernels(tmp_path):
    out = emulated("-m", "pytest", "-q", "-p", "no:cacheprovider", "-x",
                   f"--basetemp={tmp_path / 'pytest'}", *EXACTNESS_TESTS, timeout=1800)
    tail = (out.stdout + out.stderr)[-4000:]
    assert out.returncode == 0, tail
    assert " passed" in tail and "failed" not in tail, tail
