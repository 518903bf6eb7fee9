"""`trt-spec build ENGINE_DIR`: TensorRT engines from an engine folder's ONNX graphs.

    plan   = build_plan(manifest, max_batch, max_draft_tokens)    # pure: graphs, profiles, plugins
    require_tensorrt()                                             # one clear line when absent
    load_plugins(plan)                                             # explicit and logged
    for graph in plan: engine = build_engine(graph)                # strongly typed, 2 profiles
    record_engines(folder, built)                                  # manifest.json, atomically

Which graphs: those the manifest records with backend "trt" (TRT-lowered ONNX: `TRT_Attention`,
`TRT_KVCacheUpdate`, `tensorrt.plugin` nodes); a folder with none falls back to its ORT graphs,
whose inputs and symbolic axes are the same contract (their com.microsoft ops then need
plugins of those names for the parser to accept them).

Precision is the graph's: the network is strongly typed (TensorRT 11 knows no other mode), so
an fp16/bf16 export builds an fp16/bf16 engine and no builder flag changes a dtype.

Optimization profiles, one per phase, over the symbols every graph uses (onnx_export.py):

    profile   batch        new_tokens          num_logits          max_len
    prefill   1..B (1)     1..P (min(P, 128))  1..P (1)            L (fixed: the cache buffer)
    decode    1..B (B)     1..k+1 (k+1)        1..k+1 (k+1)        L

(min..max (opt)). Decode covers plain decoding (1 token), verification of k drafts (k+1) and
the drafters' own catch-up steps; a runtime picks the profile by new_tokens.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from trt_spec.runtime.manifest import MANIFEST, EngineFolderError, Manifest, file_entries

TRT_MIN_VERSION = (10, 15)
INSTALL_HINT = ("pip install tensorrt-cu13 --extra-index-url https://pypi.nvidia.com "
                "(TensorRT >= 10.15 with its builder, on a machine with an NVIDIA GPU)")
# symbols -> how each profile bounds them (see the table above)
BATCH, NEW_TOKENS, NUM_LOGITS, MAX_LEN = "batch", "new_tokens", "num_logits", "max_len"
SCALAR_SHAPE_INPUTS = ("total_sequence_length",)  # int32 [] whose value is a length


class TensorRTMissing(RuntimeError):
    """TensorRT (the `tensorrt` Python package with its builder) is not importable."""


@dataclass(frozen=True)
class Profile:
    name: str  # "prefill" | "decode"
    shapes: dict[str, tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]]  # min, opt, max
    # inputs whose *values* bound shapes (shape tensors): name -> (min, opt, max) values
    values: dict[str, tuple[int, int, int]] = field(default_factory=dict)


@dataclass(frozen=True)
class GraphPlan:
    name: str  # manifest graph name ("target", "mtp_0", ...)
    onnx: str  # file in the engine folder
    engine: str  # engine file to write
    source_backend: str  # "trt" (TRT-lowered) or "ort" (fallback)
    precision: str  # from the graph's float dtypes
    profiles: list[Profile]
    plugins: dict[str, list[str]]  # {"libraries": [...], "python_modules": [...]}


def symbol_ranges(max_batch: int, max_draft_tokens: int, max_len: int,
                  max_prefill: int) -> dict[str, dict[str, tuple[int, int, int]]]:
    """Per profile, symbol -> (min, opt, max)."""
    if max_batch < 1 or max_draft_tokens < 1 or max_prefill < 1 or max_len < 2:
        raise ValueError(f"need max_batch >= 1, max_draft_tokens >= 1, max_prefill >= 1, "
                         f"max_len >= 2; got {max_batch}, {max_draft_tokens}, {max_prefill}, "
                         f"{max_len}")
    verify = max_draft_tokens + 1
    return {
        "prefill": {BATCH: (1, 1, max_batch), NEW_TOKENS: (1, min(max_prefill, 128), max_prefill),
                    NUM_LOGITS: (1, 1, max_prefill), MAX_LEN: (max_len, max_len, max_len)},
        "decode": {BATCH: (1, max_batch, max_batch), NEW_TOKENS: (1, verify, verify),
                   NUM_LOGITS: (1, verify, verify), MAX_LEN: (max_len, max_len, max_len)},
    }


def input_profile(name: str, shape: list, ranges: dict[str, tuple[int, int, int]]):
    """One input's (min, opt, max) shapes; a concrete dim stays as it is."""
    dims = []
    for d in shape:
        if isinstance(d, int):
            dims.append((d, d, d))
        elif d in ranges:
            dims.append(ranges[d])
        else:
            raise ValueError(f"input {name!r}: symbolic axis {d!r} has no profile range; "
                             f"known: {sorted(ranges)}")
    return tuple(tuple(d[i] for d in dims) for i in range(3))


def graph_profiles(inputs: list[dict], ranges_by_profile: dict) -> list[Profile]:
    profiles = []
    for pname, ranges in ranges_by_profile.items():
        shapes = {i["name"]: input_profile(i["name"], i["shape"], ranges) for i in inputs}
        values = {i["name"]: (1, ranges[MAX_LEN][1], ranges[MAX_LEN][2]) for i in inputs
                  if i["name"] in SCALAR_SHAPE_INPUTS}
        profiles.append(Profile(pname, shapes, values))
    return profiles


def graph_precision(entry: dict) -> str:
    """The float dtype of a graph's float inputs/outputs (strongly typed: this is the engine's)."""
    floats = {t["dtype"] for t in entry["inputs"] + entry["outputs"]
              if t["dtype"] in ("float32", "float16", "bfloat16")}
    if len(floats) > 1:
        return "mixed(" + ",".join(sorted(floats)) + ")"
    return floats.pop() if floats else entry.get("precision", "unknown")


# plugin op (as export records it in a graph's "plugins") -> the module whose import registers it
PLUGIN_MODULES = {"trt_spec::SpecVerify": "trt_spec.plugins.trt_register"}


def plugin_list(entry: dict, libraries=(), python_modules=()) -> dict[str, list[str]]:
    """The graph's plugins plus the command line's, in order, once each. The manifest's
    "plugins" is the list of plugin ops export put in the graph (each mapped to the module that
    registers it, PLUGIN_MODULES), or {"libraries", "python_modules"} given explicitly."""
    recorded = entry.get("plugins") or []
    if isinstance(recorded, dict):
        libs, mods = list(recorded.get("libraries", ())), list(recorded.get("python_modules", ()))
    else:
        unknown = [op for op in recorded if op not in PLUGIN_MODULES]
        if unknown:
            raise ValueError(f"graph uses plugin ops {unknown} that trt-spec cannot register; "
                             f"known: {', '.join(PLUGIN_MODULES)} (or pass --plugin-library / "
                             "--plugin-module)")
        libs, mods = [], [PLUGIN_MODULES[op] for op in recorded]
    libs = list(dict.fromkeys([*libs, *map(str, libraries)]))
    mods = list(dict.fromkeys([*mods, *python_modules]))
    return {"libraries": libs, "python_modules": mods}


def build_plan(manifest: Manifest, max_batch: int = 8, max_draft_tokens: int = 4,
               max_prefill: int | None = None, max_len: int | None = None,
               graphs: list[str] | None = None, plugin_libraries=(),
               plugin_modules=()) -> list[GraphPlan]:
    """Every graph to build, with its profiles and plugins. Pure: no TensorRT needed."""
    all_graphs = manifest.data["graphs"]
    trt = {n: g for n, g in all_graphs.items() if g.get("backend") == "trt"}
    source = trt or {n: g for n, g in all_graphs.items() if g.get("backend") == "ort"}
    if graphs:
        unknown = sorted(set(graphs) - set(source))
        if unknown:
            raise ValueError(f"graphs {unknown} are not in {manifest.folder}; it has "
                             f"{sorted(source)}")
        source = {n: source[n] for n in graphs}
    if not source:
        raise EngineFolderError(f"{manifest.folder}: no ONNX graph to build")
    positions = manifest.config.max_position_embeddings
    max_len = max_len or positions
    if not 2 <= max_len <= positions:
        raise ValueError(f"max_len={max_len}: must be in 2..{positions}")
    ranges = symbol_ranges(max_batch, max_draft_tokens, max_len, max_prefill or max_len)
    plans = []
    for name, entry in source.items():
        onnx = next((f for f in entry["files"] if f.endswith(".onnx")), None)
        if onnx is None:
            raise EngineFolderError(f"{manifest.folder}: graph {name!r} has no .onnx file")
        plans.append(GraphPlan(name, onnx, f"{name}.engine", entry["backend"],
                               graph_precision(entry), graph_profiles(entry["inputs"], ranges),
                               plugin_list(entry, plugin_libraries, plugin_modules)))
    return plans


def plan_as_dict(plan: list[GraphPlan]) -> list[dict]:
    return [asdict(p) for p in plan]


# --- TensorRT (imported lazily: everything above runs without it) ---------------------------

def dry_run(engine_dir: str | Path, max_batch: int = 8, max_draft_tokens: int = 4,
            max_prefill: int | None = None, max_len: int | None = None,
            graphs: list[str] | None = None, plugin_libraries=(), plugin_modules=()) -> list[dict]:
    """`trt-spec build --dry-run`: what `build` would do (graphs, profiles, plugins), read from
    the folder's manifest; needs no TensorRT."""
    from trt_spec.runtime.manifest import load_manifest

    return plan_as_dict(build_plan(load_manifest(engine_dir, verify="size"), max_batch,
                                   max_draft_tokens, max_prefill, max_len, graphs,
                                   plugin_libraries, plugin_modules))


def require_tensorrt():
    """The tensorrt module, or TensorRTMissing with one line saying what and how."""
    try:
        import tensorrt as trt
    except ImportError as e:
        raise TensorRTMissing(f"TensorRT is not installed ({e}); `trt-spec build` needs it: "
                              f"{INSTALL_HINT}") from None
    version = tuple(int(x) for x in trt.__version__.split(".")[:2])
    if version < TRT_MIN_VERSION:
        raise TensorRTMissing(f"TensorRT {trt.__version__} is too old; need >= "
                              f"{'.'.join(map(str, TRT_MIN_VERSION))}: {INSTALL_HINT}")
    if not hasattr(trt, "Builder"):
        raise TensorRTMissing(f"this TensorRT ({trt.__version__}) has no builder (a lean / "
                              f"runtime-only install); {INSTALL_HINT}")
    return trt


def load_plugins(trt, logger, plugins: dict[str, list[str]], log) -> None:
    """TensorRT's own plugins, then each library (dlopen'ed by the registry) and each
    `tensorrt.plugin` module (importing it runs its @trtp.register)."""
    trt.init_libnvinfer_plugins(logger, "")
    registry = trt.get_plugin_registry()
    for lib in plugins["libraries"]:
        if not Path(lib).is_file():
            raise FileNotFoundError(f"plugin library {lib} not found")
        log(f"loading plugin library {lib}")
        registry.load_library(str(lib))
    for module in plugins["python_modules"]:
        log(f"importing plugin module {module}")
        importlib.import_module(module)


def build_engine(trt, logger, onnx_path: Path, plan: GraphPlan, workspace_bytes: int | None,
                 log) -> bytes:
    """One strongly typed engine with the plan's profiles; raises with the parser's errors."""
    builder = trt.Builder(logger)
    flags = 0
    if int(trt.__version__.split(".")[0]) < 11:  # 11: strongly typed always, flag deprecated
        flags |= 1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED)
    network = builder.create_network(flags)
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(str(onnx_path)):  # reads external data beside the file
        errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise RuntimeError(f"TensorRT cannot parse {onnx_path}: {errors}")
    config = builder.create_builder_config()
    if workspace_bytes:
        config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, workspace_bytes)
    names = {network.get_input(i).name: network.get_input(i) for i in range(network.num_inputs)}
    for p in plan.profiles:
        profile = builder.create_optimization_profile()
        for name, (lo, opt, hi) in p.shapes.items():
            if name not in names:
                raise RuntimeError(f"{onnx_path}: the network has no input {name!r}")
            if names[name].is_shape_tensor:  # its value bounds shapes: bound the value
                vlo, vopt, vhi = p.values.get(name, (1, 1, 1))
                profile.set_shape_input(name, [vlo], [vopt], [vhi])
            else:
                profile.set_shape(name, lo, opt, hi)
        config.add_optimization_profile(profile)
    log(f"building {plan.name} ({plan.precision}, profiles "
        f"{', '.join(p.name for p in plan.profiles)}) ...")
    serialized = builder.build_serialized_network(network, config)
    if serialized is None:
        raise RuntimeError(f"TensorRT failed to build {plan.name} (see its log above)")
    return bytes(serialized)


def record_engines(folder: Path, trt_version: str, built: list[GraphPlan]) -> dict:
    """Adds the engines (file checksums, profiles, plugins, TensorRT version) to the folder's
    manifest.json, written to a temporary file and renamed over it."""
    path = folder / MANIFEST
    data = json.loads(path.read_text())
    files = [p.engine for p in built]
    data["files"].update(file_entries(folder, files))
    data["extra_files"] = sorted(set(data.get("extra_files", ())) | set(files))
    engines = data.setdefault("trt", {}).setdefault("engines", {})
    data["trt"].update(version=trt_version, built_at=time.strftime("%Y-%m-%dT%H:%M:%SZ",
                                                                   time.gmtime()))
    for p in built:
        engines[p.name] = {"file": p.engine, "onnx": p.onnx, "from_backend": p.source_backend,
                           "precision": p.precision, "plugins": p.plugins,
                           "profiles": [asdict(x) for x in p.profiles]}
    tmp = path.with_name(path.name + ".partial")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    os.replace(tmp, path)
    return data["trt"]


def build(engine_dir: str | Path, max_batch: int = 8, max_draft_tokens: int = 4,
          max_prefill: int | None = None, max_len: int | None = None,
          graphs: list[str] | None = None, plugin_libraries=(), plugin_modules=(),
          workspace_gb: float | None = None, log=None) -> dict:
    """Builds every planned engine into the folder and records them; returns the manifest's
    "trt" entry."""
    from trt_spec.runtime.manifest import load_manifest

    log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    folder = Path(engine_dir)
    manifest = load_manifest(folder, verify="size")
    plan = build_plan(manifest, max_batch, max_draft_tokens, max_prefill, max_len, graphs,
                      plugin_libraries, plugin_modules)
    trt = require_tensorrt()
    logger = trt.Logger(trt.Logger.WARNING)
    log(f"TensorRT {trt.__version__}: building {len(plan)} engines in {folder}")
    loaded: set[str] = set()
    for p in plan:
        todo = {k: [x for x in v if x not in loaded] for k, v in p.plugins.items()}
        load_plugins(trt, logger, todo, log)
        loaded |= {x for v in p.plugins.values() for x in v}
        engine = build_engine(trt, logger, folder / p.onnx, p,
                              int(workspace_gb * (1 << 30)) if workspace_gb else None, log)
        partial = folder / (p.engine + ".partial")
        partial.write_bytes(engine)
        os.replace(partial, folder / p.engine)
        log(f"  wrote {p.engine} ({len(engine) / 1e6:.1f} MB)")
    return record_engines(folder, trt.__version__, plan)
