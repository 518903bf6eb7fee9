"""`trt-spec bundle` and `trt-spec verify`: an engine folder cut down to what a device runs.

A bundle is itself an engine folder (the runtime loads it like any other) holding only the
graphs of the chosen methods, the tokenizer, `requirements.txt` pinned to the runtime's
dependencies as installed here, and a manifest with a checksum per file plus a `bundle` entry:
the methods and an expected greedy output, which `verify` reproduces on the device.
"""

from __future__ import annotations

import json
import shutil
import tarfile
import tempfile
from importlib import metadata
from pathlib import Path

from trt_spec.runtime.manifest import (MANIFEST, EngineFolderError, load_manifest,
                                       rebase_source, write_manifest)
from trt_spec.runtime.methods import traits

REQUIREMENTS = "requirements.txt"
EXPECTED_PROMPT = "Name three colours."
EXPECTED_TOKENS = 16


def graphs_for(manifest, method: str) -> list[str]:
    from trt_spec.runtime.generator import drafter_entries

    entry = drafter_entries(manifest).get(method)
    return [] if entry is None else entry.all_graphs


# Dependencies of dependencies the runtime never imports: tokenizers reads tokenizer.json
# itself and imports huggingface_hub only for `from_pretrained`.
NOT_NEEDED = {"huggingface-hub"}


def _name(requirement: str) -> str:
    name = requirement.split(";")[0].strip()
    for sep in "<>=!~[ (":
        name = name.split(sep)[0]
    return name.lower().replace("_", "-")


def runtime_requirements() -> list[str]:
    """trt-spec's base dependencies (no extras) and theirs, pinned to the installed versions:
    a closed set, so `pip install --no-deps -r requirements.txt` installs exactly the runtime."""
    pins, todo, seen = [], ["trt-spec"], set()
    while todo:
        package = todo.pop()
        for req in metadata.requires(package) or []:
            name = _name(req)
            if "extra ==" in req or name in seen or name in NOT_NEEDED:
                continue
            if ";" in req and not _marker_holds(req.split(";", 1)[1]):
                continue
            seen.add(name)
            pins.append(f"{name}=={metadata.version(name)}")
            todo.append(name)
    return sorted(pins)


def _marker_holds(marker: str) -> bool:
    """An environment marker (python_version, sys_platform, ...) for this interpreter."""
    try:
        from packaging.markers import Marker
    except ImportError:  # packaging is onnxruntime's dependency; keep the requirement if absent
        return True
    return Marker(marker).evaluate({"extra": ""})


def bundle_methods(manifest, methods: list[str] | None) -> list[str]:
    """The methods to bundle (default: all the folder has), none first; ValueError naming
    the ones the folder does not have."""
    from trt_spec.runtime.generator import available_methods

    available = available_methods(manifest)
    methods = list(dict.fromkeys(methods or available))
    unknown = [m for m in methods if m not in available]
    if unknown:
        raise ValueError(f"methods {unknown} are not in {manifest.folder}; it has "
                         f"{', '.join(available)}")
    if "none" not in methods:
        methods.insert(0, "none")
    return methods


def write_expected(tmp: Path, source: Path, methods: list[str]) -> None:
    """Runs the bundle's greedy output and writes it into its manifest: the manifest just
    written, files and checksums as they are, plus the bundle entry."""
    from trt_spec.runtime.generator import Generator
    from trt_spec.runtime.scheduler import generate_ids
    from trt_spec.runtime.sampling import SamplingParams

    gen = Generator(tmp, verify="none", max_len=256)
    ids = gen.encode(EXPECTED_PROMPT)
    s = generate_ids(gen, [ids], SamplingParams(max_tokens=EXPECTED_TOKENS, ignore_eos=True))[0]
    written = gen.manifest.data
    written["bundle"] = {"from": str(source), "methods": methods,
                         "expected": {"prompt": EXPECTED_PROMPT, "prompt_ids": ids,
                                      "max_tokens": EXPECTED_TOKENS, "token_ids": s.output_ids}}
    (tmp / MANIFEST).write_text(json.dumps(written, indent=2) + "\n")


def bundle(engine_dir: str | Path, out: str | Path, methods: list[str] | None = None,
           tar: bool = False, progress=lambda msg: None) -> Path:
    """Writes the bundle folder `out` (atomically) and, with `tar`, `out`.tar.gz."""
    manifest = load_manifest(engine_dir, verify="sha256")
    methods = bundle_methods(manifest, methods)
    data = manifest.data
    graphs = {"target": data["graphs"]["target"]}
    drafters = {}
    for m in methods:
        if m in data.get("drafters", {}):
            drafters[m] = data["drafters"][m]
            graphs.update({g: data["graphs"][g] for g in graphs_for(manifest, m)})
    out = Path(out)
    if out.exists():
        raise FileExistsError(f"{out} exists; remove it or choose another OUT")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.tmp"))
    try:
        # the corpus table goes along where a bundled method drafts from it
        corpus = data.get("corpus") if any(traits(m).reads_corpus for m in methods) else None
        files = sorted({f for g in graphs.values() for f in g["files"]}
                       | {f for d in drafters.values() for f in d.get("files", ())}
                       | set(data["tokenizer"]["files"])
                       | ({corpus["file"]} if corpus else set()))
        for f in files:
            progress(f"copying {f}")
            shutil.copy2(manifest.path(f), tmp / f)  # f: checked inside the folder
        (tmp / REQUIREMENTS).write_text(
            "# The runtime's dependencies, closed and pinned as installed where this bundle was\n"
            "# made: pip install --no-deps -r requirements.txt, then trt-spec itself (its wheel,\n"
            "# no extras) with --no-deps.\n"
            + "\n".join(runtime_requirements()) + "\n")
        bundled = {**{k: v for k, v in data.items()
                      if k not in ("files", "format_version", "corpus")},
                   "graphs": graphs, "drafters": drafters,
                   "extra_files": [REQUIREMENTS] + ([corpus["file"]] if corpus else [])}
        if corpus:
            bundled["corpus"] = corpus
        if isinstance(data.get("source"), dict):  # its paths: relative to the bundle now
            bundled["source"] = rebase_source(data["source"], manifest.folder, out)
        write_manifest(tmp, bundled)
        progress("running the expected greedy output")
        write_expected(tmp, manifest.folder, methods)
        tmp.chmod(0o755)
        tmp.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if tar:
        progress(f"writing {out}.tar.gz")
        partial = out.with_name(out.name + ".tar.gz.partial")
        with tarfile.open(partial, "w:gz") as t:
            t.add(out, arcname=out.name)
        partial.replace(out.with_name(out.name + ".tar.gz"))
    return out


def verify(folder: str | Path, threads: int | None = None) -> dict:
    """Files and checksums, the pinned requirements against what is installed, and the stored
    greedy output reproduced by every bundled method. Returns a report; "ok" is the verdict."""
    from trt_spec.runtime.generator import Generator
    from trt_spec.runtime.scheduler import generate_ids
    from trt_spec.runtime.sampling import SamplingParams

    manifest = load_manifest(folder, verify="sha256")  # raises, naming the file
    info = manifest.data.get("bundle")
    if info is None:
        raise EngineFolderError(f"{manifest.folder / MANIFEST} has no 'bundle' entry: this is "
                                "an engine folder, not a bundle (make one with `trt-spec bundle`)")
    report = {"folder": str(manifest.folder), "files": len(manifest.data["files"]),
              "checksums": "ok", "requirements": [], "methods": {}}
    for line in manifest.path(REQUIREMENTS).read_text().splitlines():
        if not line or line.startswith("#"):
            continue
        name, _, want = line.partition("==")
        try:
            have = metadata.version(name)
        except metadata.PackageNotFoundError:
            have = None
        if have != want:
            report["requirements"].append(f"{name}: bundle made with {want}, "
                                          f"installed {have or 'nothing'}")
    expected = info["expected"]
    params = SamplingParams(max_tokens=expected["max_tokens"], ignore_eos=True)
    gen = Generator(manifest.folder, verify="none", max_len=256, threads=threads)
    for method in info["methods"]:
        got = generate_ids(gen, [expected["prompt_ids"]], params, method)[0].output_ids
        same = sum(a == b for a, b in zip(got, expected["token_ids"]))
        report["methods"][method] = {"tokens": len(got), "same_as_expected": same,
                                     "identical": got == expected["token_ids"]}
    # The plain greedy output must reproduce; speculative methods on quantized graphs may
    # part at a near-tie (README: int4/int8 and speculation), reported, not failed.
    report["ok"] = report["methods"]["none"]["identical"]
    return report


def describe(path: Path) -> str:
    """A bundle folder and its size, for `trt-spec bundle` to print."""
    size = sum(f.stat().st_size for f in Path(path).iterdir())
    return f"{path} ({size / 1e6:.1f} MB)"


def verify_lines(report: dict) -> list[str]:
    """`verify`'s report as the lines `trt-spec verify` prints, "ok" or "FAILED: ..." last."""
    lines = [f"{report['folder']}: {report['files']} files, checksums {report['checksums']}"]
    lines += [f"  requirement differs: {line}" for line in report["requirements"]]
    for method, r in report["methods"].items():
        lines.append(f"  {method}: {r['same_as_expected']}/{r['tokens']} tokens as expected"
                     + ("" if r["identical"] else " (differs)"))
    lines.append("ok" if report["ok"] else "FAILED: the plain greedy output differs")
    return lines
