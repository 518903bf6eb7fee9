"""Step costs measured once per engine and machine, kept for the next process.

The engine times c_B(T) the first time B streams decode with speculation (cost_probe.py):
about 3 * (K + 2) target steps, paid by the first requests at each batch size. With a cost
cache those medians are written to a small JSON file outside the engine folder (which is
checksummed and may be read-only): $TRT_SPEC_CACHE/step-costs/<key>.json, the key a hash of
what the costs depend on (the target graph's files, the backend, threads and exact decoding,
the CPU, its features as its kernels see them, its count, and ONNX Runtime's version). A
later process with the same key reads them at load and probes nothing; live steps refine them either way (draft_length.StepCosts). A file that cannot be
read or written is ignored: the engine then probes as before.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from trt_spec.runtime.backends.cpu import cpu_flags, cpu_name
from trt_spec.runtime.files import cache_dir, write_cache_file

VERSION = 2  # 2: the key names the CPU's features and ONNX Runtime's version


def cost_key(target_files: dict, backend: str, threads: int | None, exact_decode: bool) -> str:
    """A hash of everything a step's cost depends on. target_files: the target graph's files
    as the manifest lists them (name -> {sha256, bytes})."""
    return key_hash({"version": VERSION, "backend": backend, "exact_decode": exact_decode,
                     **machine_parts(target_files, threads)})


def machine_parts(target_files: dict, threads: int | None) -> dict:
    """What a measurement of the target graph on this machine depends on: its files (the
    manifest's sha256, else sizes), the CPU, its features as its kernels see them, its
    count, ONNX Runtime's version, threads (step costs and the exactness probe share it)."""
    return {"files": {n: f.get("sha256") or f.get("bytes")
                      for n, f in sorted(target_files.items())},
            "cpu": cpu_name(), "cpus": os.cpu_count(), "flags": list(cpu_flags()),
            "onnxruntime": _ort_version(), "threads": threads}


def key_hash(parts: dict) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:24]


def _ort_version() -> str | None:
    try:
        import onnxruntime

        return onnxruntime.__version__
    except ImportError:  # a GPU backend's process may run without it
        return None


class CostCache:
    """{(batch, rows): seconds} in one file."""

    def __init__(self, path: Path):
        self.path = Path(path)

    @classmethod
    def for_key(cls, key: str) -> "CostCache":
        return cls(cache_dir() / "step-costs" / f"{key}.json")

    def load(self) -> dict[tuple[int, int], float]:
        try:
            data = json.loads(self.path.read_text())
            return {(int(b), int(t)): float(s) for b, t, s in data["costs"]}
        except (OSError, ValueError, KeyError, TypeError):
            return {}

    def save(self, costs: dict[tuple[int, int], float]) -> None:
        """Merges `costs` into the file (written whole, then renamed into place)."""
        merged = {**self.load(), **costs}
        body = json.dumps({"version": VERSION, "costs": [[b, t, s] for (b, t), s
                                                          in sorted(merged.items())]})
        write_cache_file(self.path, body)  # unwritable: the next process probes again
