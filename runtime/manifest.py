"""The engine folder's manifest.json: what is in the folder, and whether it is intact.

The exporter writes it (`write_manifest`); the runtime reads it (`load_manifest`) and refuses
a folder whose files are missing, changed, or of another format version, naming the file.

A folder only ever reads its own files: every name the manifest holds must be a relative path
that resolves inside the folder, symlinks followed (`contained`). Engine folders and bundles
are what gets shipped to devices, so a manifest naming `/etc/passwd` or `../x` is refused at
load, `verify` and `bundle`, whatever its checksums say. Its layout is checked before it is
read (`check_schema`): a malformed manifest is answered with one line naming the file and the
field, never a traceback.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path, PurePosixPath, PureWindowsPath

from trt_spec.runtime.config import ModelConfig

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
HUB_PREFIX = "hf://"  # a source model or drafter on the Hugging Face hub, never a path


class EngineFolderError(ValueError):
    """The engine folder is missing, corrupt or does not match this runtime."""


def contained(folder: Path, name, where: str) -> Path:
    """folder / name, refused (EngineFolderError naming `where`) unless `name` is a relative
    path with no `..` that resolves inside `folder` with every symlink followed."""
    if not isinstance(name, str) or not name:
        raise EngineFolderError(f"{where}: file name {name!r} must be a non-empty string")
    if (PurePosixPath(name).is_absolute() or PureWindowsPath(name).is_absolute()
            or PureWindowsPath(name).drive or name.startswith(("/", "\\"))):
        raise EngineFolderError(f"{where}: file {name!r} is an absolute path; an engine folder "
                                "may only name files inside itself (relative paths)")
    if ".." in PurePosixPath(name.replace("\\", "/")).parts or "\0" in name:
        raise EngineFolderError(f"{where}: file {name!r} leads out of the folder ('..'); an "
                                "engine folder may only name files inside itself")
    root = folder.resolve()
    path = (root / name).resolve()
    if not path.is_relative_to(root):
        raise EngineFolderError(f"{where}: file {name!r} resolves to {path}, outside the folder "
                                f"{root} (a symlink leading out); an engine folder may only "
                                "read its own files")
    return folder / name


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
        """The file `name` of this folder (refused unless it resolves inside the folder)."""
        return contained(self.folder, name, str(self.folder / MANIFEST))


def source_path(manifest: Manifest | str | Path, value):
    """A model or drafter path the manifest's "source" records ("model", "draft_model", the
    "heads" values), as this machine reads it. Export records local paths relative to the
    engine folder (`relative_source_path`), so a folder moved or copied together with its
    source checkpoints still finds them: such a value -> folder / value. Model names
    ("smollm2-135m") and absolute paths (folders exported before) come back as they are, and
    so does a relative path that exists only from the working directory (an older export's
    value as typed). None / "" and hub names (hf://org/name@commit, export/hub.py) come
    back as they are."""
    if not isinstance(value, str) or not value or os.path.isabs(value) \
            or value.startswith(HUB_PREFIX):
        return value
    folder = manifest.folder if isinstance(manifest, Manifest) else Path(manifest)
    beside = folder / value
    if beside.exists():
        return os.path.normpath(beside)
    if Path(value).exists():  # an older folder's path, relative to where it was exported
        return value
    if "/" in value or "\\" in value:  # a path, missing: name where the manifest says it is
        return os.path.normpath(beside)
    return value  # a model name


def relative_source_path(path: str | Path, folder: str | Path) -> str:
    """A local `path` as the manifest records it: relative to the engine folder `folder`
    (forward slashes, always with one, so that it never reads as a model name). An absolute
    path where no relative one exists (another drive)."""
    try:
        rel = os.path.relpath(os.path.abspath(path), os.path.abspath(folder))
    except ValueError:
        return os.path.abspath(path)
    rel = rel.replace(os.sep, "/")
    return rel if "/" in rel else f"./{rel}"


def rebase_source(source: dict, folder: str | Path, new_folder: str | Path) -> dict:
    """`source` (a manifest's, recorded relative to `folder`) as recorded for a copy of the
    folder's contents in `new_folder` (a bundle): its relative paths rewritten, names and
    absolute paths kept."""
    def rebase(value):
        resolved = source_path(folder, value)
        return value if resolved == value else relative_source_path(resolved, new_folder)

    out = dict(source)
    for key in ("model", "draft_model"):
        if key in out:
            out[key] = rebase(out[key])
    if isinstance(out.get("heads"), dict):
        out["heads"] = {k: rebase(v) for k, v in out["heads"].items()}
    return out


_SHA256 = re.compile(r"[0-9a-f]{64}")


def _kind(value) -> str:
    return {dict: "an object", list: "a list", str: "a string", int: "an integer",
            float: "a number", bool: "a boolean", type(None): "null"}.get(type(value),
                                                                         type(value).__name__)


def check_schema(data, path: Path) -> None:
    """The manifest's layout, before anything reads it: one EngineFolderError naming the file
    and the field (`graphs.target.backend`), the value's type and what is expected."""
    def need(value, kind: type, field: str, what: str):
        ok = isinstance(value, kind) and not (kind is int and isinstance(value, bool))
        if not ok:
            raise EngineFolderError(f"{path}: {field} is {_kind(value)} ({str(value)[:60]!r}); "
                                    f"expected {what}")
        return value

    def names(value, field: str) -> list[str]:
        need(value, list, field, "a list of file names")
        for i, name in enumerate(value):
            need(name, str, f"{field}[{i}]", "a file name (a string)")
        return value

    need(data, dict, "the top level", "a JSON object")
    for key in ("model_config", "graphs", "tokenizer", "files"):
        if key not in data:
            raise EngineFolderError(f"{path}: required key {key!r} is missing")
    need(data["model_config"], dict, "model_config", "an object")
    files = need(data["files"], dict, "files", "an object {file name: {bytes, sha256}}")
    for name, entry in files.items():
        field = f"files[{name!r}]"
        need(entry, dict, field, "an object {bytes, sha256}")
        for key in ("bytes", "sha256"):
            if key not in entry:
                raise EngineFolderError(f"{path}: {field} has no {key!r}")
        if need(entry["bytes"], int, f"{field}.bytes", "an integer >= 0") < 0:
            raise EngineFolderError(f"{path}: {field}.bytes is {entry['bytes']}; expected >= 0")
        sha = need(entry["sha256"], str, f"{field}.sha256", "64 hex digits")
        if not _SHA256.fullmatch(sha):
            raise EngineFolderError(f"{path}: {field}.sha256 is {sha[:70]!r}; expected 64 "
                                    "lowercase hex digits")
    tokenizer = need(data["tokenizer"], dict, "tokenizer", "an object with 'files'")
    listed = [("tokenizer.files", f) for f in names(tokenizer.get("files"), "tokenizer.files")]
    graphs = need(data["graphs"], dict, "graphs", "an object {graph name: entry}")
    if "target" not in graphs:
        raise EngineFolderError(f"{path}: graphs has no 'target' (it has {sorted(graphs)})")
    for gname, graph in graphs.items():
        field = f"graphs.{gname}"
        need(graph, dict, field, "an object")
        for key, kind, what in (("files", list, "a list of file names"),
                                ("backend", str, "a backend name ('ort', 'trt')")):
            if key not in graph:
                raise EngineFolderError(f"{path}: {field} has no {key!r}")
            need(graph[key], kind, f"{field}.{key}", what)
        if not names(graph["files"], f"{field}.files"):
            raise EngineFolderError(f"{path}: {field}.files is empty; expected the graph's file")
        for key in ("inputs", "outputs"):
            if key in graph:
                for i, tensor in enumerate(need(graph[key], list, f"{field}.{key}", "a list")):
                    need(tensor, dict, f"{field}.{key}[{i}]", "an object with 'name'")
                    need(tensor.get("name"), str, f"{field}.{key}[{i}].name", "a string")
        listed += [(f"{field}.files", f) for f in graph["files"]]
    drafters = need(data.get("drafters", {}), dict, "drafters", "an object {method: entry}")
    for method, entry in drafters.items():
        field = f"drafters.{method}"
        need(entry, dict, field, "an object")
        refs = [entry["graph"]] if "graph" in entry else []
        refs += list(need(entry.get("graphs", []), list, f"{field}.graphs", "a list of graph "
                          "names"))
        refs += [entry["fc_graph"]] if "fc_graph" in entry else []
        if not refs:
            raise EngineFolderError(f"{path}: {field} names no graph ('graph' or 'graphs')")
        for ref in refs:
            if not isinstance(ref, str) or ref not in graphs:
                raise EngineFolderError(f"{path}: {field} uses graph {ref!r}, which is not in "
                                        f"graphs ({sorted(graphs)})")
        for key in ("model_config", "layer_config"):
            if key in entry:
                need(entry[key], dict, f"{field}.{key}", "an object")
        if "d2t" in entry:
            listed.append((f"{field}.d2t", need(entry["d2t"], str, f"{field}.d2t", "a file name")))
        if "files" in entry:
            listed += [(f"{field}.files", f) for f in names(entry["files"], f"{field}.files")]
    extra = data.get("extra_files", [])
    listed += [("extra_files", f) for f in names(extra, "extra_files")]
    for field, name in listed:
        if name not in files:
            raise EngineFolderError(f"{path}: {field} names {name!r}, which has no entry in "
                                    "files (no size or checksum)")


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
    contained(folder, MANIFEST, str(folder))  # manifest.json itself: no symlink out
    try:
        data = json.loads(path.read_bytes().decode("utf-8"))
    except UnicodeDecodeError as e:
        raise EngineFolderError(f"{path} is not UTF-8 text (byte {e.object[e.start]:#04x} at "
                                f"offset {e.start}): not a manifest; re-export the folder") from e
    except (json.JSONDecodeError, RecursionError) as e:
        raise EngineFolderError(f"{path} is not valid JSON: {e}") from e
    version = data.get("format_version") if isinstance(data, dict) else None
    if isinstance(data, dict) and version != FORMAT_VERSION:
        raise EngineFolderError(f"{path}: format_version {version!r}, this runtime reads "
                                f"{FORMAT_VERSION}; re-export the folder")
    check_schema(data, path)
    try:
        config = ModelConfig.from_dict(data["model_config"])
    except (TypeError, ValueError, KeyError) as e:
        raise EngineFolderError(f"{path}: bad model_config: {e!r}") from e
    for name, entry in data["files"].items():
        file = contained(folder, name, f"{path}: files")
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
    return Manifest(folder, data, config)
