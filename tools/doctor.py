"""`trt-spec doctor`: what this machine can run, and whether an engine folder fits it."""

from __future__ import annotations

import os
import platform
import shutil
import sys
from importlib import metadata, util
from pathlib import Path

from trt_spec.runtime.cost_cache import cpu_name

# CPU features that decide which ONNX Runtime kernels run fast (MatMulNBits' int8 compute
# path, accuracy level 4, wants AVX2 at least; VNNI / AMX make it faster).
CPU_FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx_vnni", "amx_int8", "asimd", "sve")


def cpu_flags() -> list[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return []
    flags = set()
    for line in text.splitlines():
        if line.startswith(("flags", "Features")):
            flags |= set(line.split(":", 1)[1].split())
    found = [f for f in CPU_FLAGS if f in flags]
    return ["neon" if f == "asimd" else f for f in found]


def cpu_model() -> str:
    return cpu_name()


def version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def gpus() -> list[str]:
    """NVIDIA GPUs by their device nodes (no driver library needed to ask)."""
    return sorted(str(p) for p in Path("/dev").glob("nvidia[0-9]*"))


def machine_report() -> dict:
    import onnxruntime as ort

    from trt_spec.runtime.backends.ort import default_threads

    return {
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "cpu_features": cpu_flags(),
        "threads": default_threads(),
        "onnxruntime": ort.__version__,
        "ort_providers": ort.get_available_providers(),
        "gpus": gpus(),
        "nvidia_smi": shutil.which("nvidia-smi") is not None,
        "tensorrt": version("tensorrt") if util.find_spec("tensorrt") else None,
        "torch": version("torch"),  # export needs it; the runtime does not
        "transformers": version("transformers"),
    }


def engine_report(engine_dir: str | Path, machine: dict) -> dict:
    from trt_spec.runtime.generator import available_methods
    from trt_spec.runtime.manifest import load_manifest

    manifest = load_manifest(engine_dir, verify="size")
    data = manifest.data
    problems, notes = [], []
    backends = {g["backend"] for g in data["graphs"].values()}
    precisions = sorted({g["precision"] for g in data["graphs"].values()})
    if "trt" in backends and not machine["tensorrt"]:
        problems.append("the folder has TensorRT engines and TensorRT is not installed")
    if any(p.startswith(("int4", "int8")) for p in precisions) and "avx2" not in machine["cpu_features"] \
            and "neon" not in machine["cpu_features"]:
        notes.append("int4/int8 graphs run without AVX2/NEON here: MatMulNBits falls back to "
                     "slow kernels")
    size = sum(e["bytes"] for e in data["files"].values())
    return {"folder": str(manifest.folder), "backends": sorted(backends),
            "precisions": precisions, "graphs": sorted(data["graphs"]),
            "methods": available_methods(manifest),
            "bytes": size, "bundle": "bundle" in data,
            "runs_here": not problems, "problems": problems, "notes": notes}


def report(engine: str | Path | None = None) -> dict:
    """`trt-spec doctor`: {"machine": ..., and with `engine`, "engine": ...}. ValueError for
    an engine folder that cannot be read."""
    out = {"machine": machine_report()}
    if engine:
        out["engine"] = engine_report(engine, out["machine"])
    return out


def runs_here(report: dict) -> bool:
    """False when the report names an engine folder that does not run on this machine."""
    return "engine" not in report or report["engine"]["runs_here"]


def report_text(report: dict) -> str:
    """The report as `trt-spec doctor` prints it."""
    m = report["machine"]
    lines = [
        f"python {m['python']} on {m['platform']}",
        f"cpu: {m['cpu']}, {m['cores']} cores; features: {' '.join(m['cpu_features']) or 'none known'}",
        f"threads in use: {m['threads']} (--threads or $TRT_SPEC_THREADS)",
        f"onnxruntime {m['onnxruntime']}: {', '.join(m['ort_providers'])}",
        f"gpu: {', '.join(m['gpus']) or 'none'}; tensorrt: {m['tensorrt'] or 'not installed'}",
        f"export tools: torch {m['torch'] or 'absent'}, transformers {m['transformers'] or 'absent'}",
    ]
    if "engine" in report:
        e = report["engine"]
        lines.append(f"engine {e['folder']}: {', '.join(e['precisions'])} on "
                     f"{', '.join(e['backends'])}, {e['bytes'] / 1e6:.1f} MB, methods "
                     f"{', '.join(e['methods'])}{' (bundle)' if e['bundle'] else ''}")
        lines += [f"  problem: {p}" for p in e["problems"]] + [f"  note: {n}" for n in e["notes"]]
        lines.append("  runs here" if e["runs_here"] else "  does NOT run here")
    return "\n".join(lines)
