"""`trt-spec doctor`: what this machine can run, and whether an engine folder fits it."""

from __future__ import annotations

import os
import platform
import shutil
import sys
from importlib import metadata, util
from pathlib import Path

from trt_spec.runtime import memory
from trt_spec.runtime.backends.cpu import cpu_flags as cpu_flags_of_cpu
from trt_spec.runtime.backends.cpu import cpu_kind, cpu_name

def cpu_flags() -> list[str]:
    """The CPU features ONNX Runtime's kernels dispatch on, as CPUID reports them
    (runtime/backends/cpu.py: under an emulator, the emulated CPU's)."""
    return ["neon" if f == "asimd" else f for f in cpu_flags_of_cpu()]


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
        "cpu_kind": cpu_kind(),
        "threads": default_threads(),
        "onnxruntime": ort.__version__,
        "ort_providers": ort.get_available_providers(),
        "gpus": gpus(),
        "nvidia_smi": shutil.which("nvidia-smi") is not None,
        "tensorrt": version("tensorrt") if util.find_spec("tensorrt") else None,
        "torch": version("torch"),  # export needs it; the runtime does not
        "transformers": version("transformers"),
    }


def engine_report(engine_dir: str | Path, machine: dict, runtime=None) -> dict:
    """runtime: the RuntimeConfig the folder would be served with (slots, context, backend:
    what its memory is counted at; default: `serve`'s)."""
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
    held = memory_report(manifest, runtime or serve_config())
    if not held["fits"]:
        problems.append(f"its weights and caches need {held['total_text']}, more than "
                        f"{held['utilization_text']} of the {held['available_text']} "
                        f"available on {held['where']}")
    exact = exact_decoding(manifest) if not problems else None
    return {"exact_decoding": exact, "memory": held,
            "folder": str(manifest.folder), "backends": sorted(backends),
            "precisions": precisions, "graphs": sorted(data["graphs"]),
            "methods": available_methods(manifest),
            "bytes": size, "bundle": "bundle" in data,
            "runs_here": not problems, "problems": problems, "notes": notes}


def serve_config():
    """The settings `trt-spec serve` runs a folder with by default."""
    from trt_spec.runtime.settings import SERVE_MAX_BATCH, RuntimeConfig

    return RuntimeConfig(max_batch=SERVE_MAX_BATCH)


def memory_report(manifest, runtime) -> dict:
    """What the folder's weights and caches take at `runtime`'s slots and context, against
    the memory available (runtime/memory.py: the check `serve` makes), and what would fit."""
    from trt_spec.runtime.generator import drafter_entries

    plan = memory.memory_plan(manifest, runtime, drafter_entries(manifest))
    have = memory.available(plan.where)
    budget = None if have is None else int(have * runtime.memory_utilization)
    fits = budget is None or plan.total <= budget
    return {**plan.to_json(), "available": have, "utilization": runtime.memory_utilization,
            "fits": fits, "what_fits": [] if fits else memory.what_fits(plan, budget),
            "total_text": memory.size(plan.total),
            "utilization_text": memory.percent(runtime.memory_utilization),
            "available_text": "?" if have is None else memory.size(have),
            "table": plan.table(have)}


def exact_decoding(manifest) -> dict | None:
    """Whether exact decoding holds for the folder's ONNX Runtime target on this machine, by
    which row layout, and what it costs a plain step (runtime/backends/exact_rows.py; probed once,
    then read from the cache). None for a folder without an ORT target."""
    if manifest.graph("target")["backend"] != "ort":
        return None
    from trt_spec.runtime.backends.ort import OrtGraphs

    target = OrtGraphs(manifest).step_graph("target", manifest.config)
    found = target.exactness
    return {"holds": found.holds, "by": found.rule.describe(), "rule": found.to_json()["rule"],
            "plain_step_ms": round(found.plain_ms, 3), "fast_step_ms": round(found.fast_ms, 3),
            "cost": round(found.cost, 4), "covers": [found.max_batch, found.max_tokens],
            "refused": found.failed, "text": found.describe()}


def report(engine: str | Path | None = None, runtime=None) -> dict:
    """`trt-spec doctor`: {"machine": ..., and with `engine`, "engine": ...}. runtime: the
    settings the folder's memory is counted at (default: `serve`'s). ValueError for an engine
    folder that cannot be read."""
    out = {"machine": machine_report()}
    if engine:
        out["engine"] = engine_report(engine, out["machine"], runtime)
    return out


def runs_here(report: dict) -> bool:
    """False when the report names an engine folder that does not run on this machine."""
    return "engine" not in report or report["engine"]["runs_here"]


def report_text(report: dict) -> str:
    """The report as `trt-spec doctor` prints it."""
    m = report["machine"]
    lines = [
        f"python {m['python']} on {m['platform']}",
        f"cpu: {m['cpu']}, {m['cores']} cores; features: {' '.join(m['cpu_features']) or 'none known'}"
        f" (kernels: {m['cpu_kind']})",
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
        lines += [f"  {line}" for line in e["memory"]["table"]]
        lines += [f"    would fit: {f}" for f in e["memory"]["what_fits"]]
        if e.get("exact_decoding"):
            x = e["exact_decoding"]
            lines.append(f"  exact decoding {x['text']}")
            lines += [f"    refused: {r}" for r in x["refused"]]
        lines.append("  runs here" if e["runs_here"] else "  does NOT run here")
    return "\n".join(lines)
