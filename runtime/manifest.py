"""The engine folder's manifest.json: what is in the folder, and whether it is intact.

The exporter writes it (`write_manifest`); the runtime reads it (`load_manifest`) and refuses
a folder whose files are missing, changed, or of another format version, naming the file.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from trt_spec.runtime.config import ModelConfig

FORMAT_VERSION = 1
MANIFEST = "manifest.json"


class EngineFolderError(ValueError):
    """The engine folder is missing, corrupt or does not match this runtime."""


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def file_entries(folder: Path, names: list[str]) -> dict[str, dict]:
    return {n: {"bytes": (folder / n).stat().st_size, "sha256": sha256(folder / n)} for n in names}


def manifest_digest(folder: str | Path) -> str:
    """The sha256 of the folder's manifest.json: it holds a sha256 per file, so this one
    digest names the whole export (`trt-spec serve --ray --engine-checksum`)."""
    path = Path(folder) / MANIFEST
    if not path.is_file():
        raise EngineFolderError(f"{path} is missing: {folder} is not an engine folder")
    return sha256(path)


def write_manifest(folder: Path, manifest: dict) -> None:
    """`manifest` without "files": every graph, data and tokenizer file it names is hashed."""
    names = sorted({f for g in manifest["graphs"].values() for f in g["files"]}
                   | {f for d in manifest.get("drafters", {}).values() for f in d.get("files", ())}
                   | set(manifest.get("extra_files", ()))
                   | set(manifest["tokenizer"]["files"]))
    manifest = {"format_version": FORMAT_VERSION, **manifest, "files": file_entries(folder, names)}
    (folder / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")


@dataclass(frozen=True)
class Manifest:
    folder: Path
    data: dict
    config: ModelConfig

    def graph(self, name: str) -> dict:
        graphs = self.data["graphs"]
        if name not in graphs:
            raise EngineFolderError(f"{self.folder / MANIFEST}: no graph {name!r}; "
                                    f"this folder has {sorted(graphs)}")
        return graphs[name]

    def path(self, name: str) -> Path:
        return self.folder / name


def load_manifest(folder: str | Path, verify: str = "sha256") -> Manifest:
    """verify: "sha256" (hash every file), "size" (sizes only) or "none"."""
    folder = Path(folder)
    if verify not in ("sha256", "size", "none"):
        raise ValueError(f"verify={verify!r}: expected 'sha256', 'size' or 'none'")
    path = folder / MANIFEST
    if not folder.is_dir():
        raise EngineFolderError(f"engine folder {str(folder)!r} does not exist "
                                "(create it with `trt-spec export`)")
    if not path.is_file():
        raise EngineFolderError(f"{path} is missing: {folder} is not an engine folder")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise EngineFolderError(f"{path} is not valid JSON: {e}") from e
    version = data.get("format_version")
    if version != FORMAT_VERSION:
        raise EngineFolderError(f"{path}: format_version {version!r}, this runtime reads "
                                f"{FORMAT_VERSION}; re-export the folder")
    for key in ("model_config", "graphs", "tokenizer", "files"):
        if key not in data:
            raise EngineFolderError(f"{path}: required key {key!r} is missing")
    try:
        config = ModelConfig.from_dict(data["model_config"])
    except (TypeError, ValueError) as e:
        raise EngineFolderError(f"{path}: bad model_config: {e}") from e
    for name, entry in data["files"].items():
        file = folder / name
        if not file.is_file():
            raise EngineFolderError(f"{file} is missing (listed in {path})")
        if verify == "none":
            continue
        size = file.stat().st_size
        if size != entry["bytes"]:
            raise EngineFolderError(f"{file} has {size} bytes, the manifest says "
                                    f"{entry['bytes']}: the file is corrupt or from another export")
        if verify == "sha256" and sha256(file) != entry["sha256"]:
            raise EngineFolderError(f"{file}: checksum differs from {path}: the file is corrupt "
                                    "or from another export")
    for gname, graph in data["graphs"].items():
        for f in graph["files"]:
            if f not in data["files"]:
                raise EngineFolderError(f"{path}: graph {gname!r} uses {f}, which has no checksum")
    return Manifest(folder, data, config)
