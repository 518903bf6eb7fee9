"""`trt-spec export`: model -> engine folder (graphs, tokenizer, manifest), written atomically."""

from __future__ import annotations

import dataclasses
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from trt_spec.export.attention_rows import SPEC as ATTENTION_ROWS_SPEC
from trt_spec.export.attention_rows import pad_attention_rows
from trt_spec.export.checkpoint import KNOWN_MODELS, load_into, load_target, resolve_model
from trt_spec.export.drafter_checkpoint import is_draft_folder, load_draft, load_drafter
from trt_spec.export.drafters import KINDS, Drafter, head_vocab, restrict_head
from trt_spec.export.model import TargetModel
from trt_spec.export.onnx_export import (drafter_io, export_drafter, export_fc, export_score,
                                         export_target, fc_io, save_with_external_data,
                                         score_io, target_io)
from trt_spec.export.quantize import embedding_int8, matmuls_to_nbits, tie_embedding_int8
from trt_spec.plugins.lowering import lowering
from trt_spec.runtime.manifest import (MANIFEST, load_manifest, relative_source_path,
                                       write_manifest)
from trt_spec.runtime.methods import METHODS

PRECISIONS = {"ort": ("fp32", "int8", "int4", "int4-head8", "int4-plain", "int8-rows"),
              "trt": ("fp32", "fp16")}
FLOAT = {"fp16": "float16"}  # the graphs' float dtype by precision; float32 otherwise

# Weight form per MatMul (export/quantize.py FORMS), by precision. The head (output "logits")
# stays 8-bit under int4: logits are where int4 error would land directly, and the default
# GGUF's embedding is Q8_0, which 8-bit symmetric blocks reproduce exactly. (A tied head is
# handled by tie_embedding_int8.) "int4" keeps a Q4_1 GGUF's weights (the residual form);
# "int4-plain" is the integer-zero-point form alone, 4% fewer bytes and not the same model
# (docs/quantization.md has both measured).
FORMS = {
    "int8": lambda output, shape: "int8",
    "int4": lambda output, shape: "int8" if output == "logits" else "int4+residual",
    "int4-plain": lambda output, shape: "int8" if output == "logits" else "int4",
    "int8-rows": lambda output, shape: "int8" if output == "logits" else "int8-rows",
}
FORMS["int4-head8"] = FORMS["int4"]  # the same body; only the head differs (HEAD_RESCORE)
# A tied head under int4 reads a 4-bit copy of the int8 table and computes each row's top
# logits again from the int8 rows (export/quantize.py rescored_head): the head is the largest
# matrix a step reads (49152 x 576 on SmolLM2), and memory-bound. "int4-head8" is int4 with
# the whole head at 8 bits: 2-3% slower on SmolLM2, the tail of the distribution exact.
HEAD_RESCORE = {"int4": 128, "int4-plain": 128, "int8-rows": 128}
BACKENDS = tuple(PRECISIONS)
# Bumped when a graph's lowering changes (weight forms, attention rows), so that `export`
# redoes folders made before.
LOWERING_VERSION = 5

# --draft-vocab: the vocabulary the MTP, Eagle and vanilla-draft heads draft over.
# "eagle3": the Eagle3 head's (its d2t); "none": the target's full vocabulary.
DRAFT_VOCABS = ("eagle3", "none")


def resolve_draft_vocab(draft_vocab: str | None, heads: dict[str, str]) -> str:
    """--draft-vocab's value -> one of DRAFT_VOCABS. Default (None): "eagle3" when an Eagle3
    head is exported (reuse its draft vocabulary), else "none"."""
    if draft_vocab is None:
        return "eagle3" if "eagle3" in heads else "none"
    value = str(draft_vocab).strip().lower()
    if value.isdigit():
        raise ValueError(
            f"--draft-vocab {draft_vocab!r}: a draft vocabulary of N tokens needs token "
            "frequencies, and export has no token-frequency source; use 'eagle3' (the Eagle3 "
            "head's draft vocabulary) or 'none' (full heads)")
    if value not in DRAFT_VOCABS:
        raise ValueError(f"--draft-vocab {draft_vocab!r}: expected one of "
                         f"{', '.join(DRAFT_VOCABS)}")
    if value == "eagle3" and "eagle3" not in heads:
        raise ValueError("--draft-vocab 'eagle3' reuses the Eagle3 head's draft vocabulary, and "
                         "this export has no Eagle3 head (give --eagle3 DIR, or --draft-vocab "
                         "none)")
    return value


def restrict_heads(draft_vocab: str, draft, drafters: dict[str, Drafter]):
    """In place: the vanilla draft's and the MTP / Eagle heads keep only the rows of the
    draft vocabulary `draft_vocab` (one of DRAFT_VOCABS, resolved) -> its d2t [draft_vocab]
    int64, or None for "none". Eagle3's own head is already over it."""
    assert draft_vocab in DRAFT_VOCABS, draft_vocab
    if draft_vocab == "none":
        return None
    d2t = drafters["eagle3"].d2t
    for kind in ("mtp", "eagle"):
        if kind in drafters:
            for module in drafters[kind].modules:
                restrict_head(module, d2t)
            drafters[kind].d2t = d2t
    if draft is not None:
        restrict_head(draft, d2t)
    return d2t


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def copy_tokenizer(hf_dir: Path, out: Path) -> list[str]:
    """tokenizer.json plus a tokenizer_config.json that carries the chat template inline."""
    if not (hf_dir / "tokenizer.json").exists():
        raise FileNotFoundError(f"{hf_dir} has no tokenizer.json (a fast tokenizer is required)")
    shutil.copy(hf_dir / "tokenizer.json", out / "tokenizer.json")
    cfg_path = hf_dir / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text()) if cfg_path.exists() else {}
    template = hf_dir / "chat_template.jinja"
    if "chat_template" not in cfg and template.exists():
        cfg["chat_template"] = template.read_text()
    keep = ("bos_token", "eos_token", "unk_token", "pad_token", "chat_template")
    (out / "tokenizer_config.json").write_text(
        json.dumps({k: cfg[k] for k in keep if k in cfg}, indent=2) + "\n")
    return ["tokenizer.json", "tokenizer_config.json"]


def truncated_draft(target: TargetModel, layers: int) -> TargetModel:
    """A layer-truncated self-draft: the target's first `layers` decoder layers, its final
    norm and its head (tied or not). Weak but real; it needs no training."""
    config = target.config
    if not 1 <= layers < config.num_layers:
        raise ValueError(f"--draft-layers {layers}: must be in 1..{config.num_layers - 1} "
                         f"(the target has {config.num_layers} layers)")
    draft_config = dataclasses.replace(config, num_layers=layers, eagle3_layers=())
    draft = TargetModel(draft_config)
    state = {k: v for k, v in target.state_dict().items()
             if not k.startswith("layers.") or int(k.split(".")[1]) < layers}
    load_into(draft, state)
    return draft.eval()


def export_graph(trace, folder: Path, name: str, precision: str, backend: str,
                 io: tuple[list[dict], list[dict]],
                 shared: dict[str, tuple[str, int, int]] | None = None) -> dict:
    """`trace()` returns a traced graph; it is lowered to `precision` here and written once,
    to `<name>.onnx` (+ .data) in `folder`, where tensors whose bytes an earlier graph of the
    folder already wrote (`shared`, see save_with_external_data) are read from there.
    Returns its manifest entry."""
    graph = folder / f"{name}.onnx"
    log(f"exporting {name} to ONNX ({backend} lowering) ...")
    with lowering(backend):
        proto = trace()
    aliases = None
    if precision in FORMS:
        log(f"quantizing {name} to {precision} ("
            + ("8-bit columns x 8-bit rows, MatMulIntegerToFloat" if precision == "int8-rows" else
               "MatMulNBits, block 32, accuracy level 4") + ") ...")
        rescore = HEAD_RESCORE.get(precision, 0)
        # before the generic pass: the head is special
        aliases = tie_embedding_int8(proto, rescore_top=rescore)
        tied = aliases is not None
        tables = 0 if tied else embedding_int8(proto)
        errors: dict[str, tuple[str, float]] = {}
        n = matmuls_to_nbits(proto, FORMS[precision], errors=errors)
        log(f"  {n} MatMuls quantized"
            + (", embedding and lm_head share one int8 table" if tied else "")
            + (f" (the head: 4-bit, its top {rescore} rescored from it)"
               if tied and rescore else "")
            + (", embedding to int8" if tables else ""))
    inputs, outputs = io
    if backend == "ort" and pad_attention_rows(proto):  # exact decoding inside the graph
        inputs = inputs + [ATTENTION_ROWS_SPEC]
    others = save_with_external_data(proto, graph, aliases, shared)
    if others:
        log(f"  {name} reads tensors it shares with earlier graphs from {', '.join(others)}")
    entry = {
        "files": [graph.name, graph.name + ".data", *others],
        "backend": backend,
        "precision": precision,
        "inputs": inputs,
        "outputs": outputs,
    }
    if precision in FORMS:
        entry["weights"] = weights_entry(errors)
    if backend == "trt":
        entry.update(trt_entry(proto, inputs, outputs))
    if any(i["name"].startswith("past_key_values.") for i in inputs):
        kv = next(i for i in inputs if i["name"].startswith("past_key_values."))
        entry["kv_cache"] = {"layout": "[batch, kv_heads, max_len, head_dim]", "dtype": kv["dtype"],
                             "in_place": "past and present share one buffer"}
    return entry


def weights_entry(errors: dict[str, tuple[str, float]]) -> dict:
    """What the manifest records of a graph's quantized MatMuls: per form, how many and their
    relative weight error |W_q - W|_F / |W|_F against the weights exported (median, max)."""
    forms: dict[str, list[float]] = {}
    for form, error in errors.values():
        forms.setdefault(form, []).append(error)
    return {form: {"matmuls": len(e), "relative_error_median": round(float(np.median(e)), 6),
                   "relative_error_max": round(float(np.max(e)), 6)}
            for form, e in sorted(forms.items())}


def trt_entry(proto, inputs: list[dict], outputs: list[dict]) -> dict:
    """What TensorRT's builder needs beyond the I/O specs: each tensor's symbolic axes (for
    optimization profiles), the non-standard ops the graph holds, and the plugins among them
    (namespace::name, to register / load before parsing)."""
    custom = sorted({f"{n.domain}::{n.op_type}" for n in proto.graph.node
                     if n.domain not in ("", "ai.onnx")})
    axes = {t["name"]: {str(i): d for i, d in enumerate(t["shape"]) if isinstance(d, str)}
            for t in inputs + outputs}
    return {"dynamic_axes": axes, "custom_ops": custom,
            "plugins": [op for op in custom if op.startswith("trt_spec::")]}


def vocab_map_entry(d2t, folder: Path, kind: str) -> dict:
    """Writes a head's draft vocabulary map `<kind>_d2t.npy` (d2t [draft_vocab] int64) ->
    what the drafter's manifest entry records of it; {} for a full-vocabulary head."""
    if d2t is None:
        return {}
    name = METHODS[kind].d2t_file()
    np.save(folder / name, d2t.numpy().astype(np.int64))
    return {"d2t": name, "files": [name], "draft_vocab_size": len(d2t)}


def export_drafter_graphs(drafter: Drafter, folder: Path, precision: str, backend: str,
                          source: str, shared: dict) -> tuple[dict, dict]:
    """A drafter's graphs (+ its vocabulary map) -> (graph entries, drafters entry)."""
    graphs = {}
    kind = drafter.kind
    method = METHODS[kind]
    names = method.graphs(len(drafter.modules))
    for name, module in zip(names, drafter.modules):
        vocab = head_vocab(module)
        assert vocab == (module.config.vocab_size if drafter.d2t is None else len(drafter.d2t))
        graphs[name] = export_graph(lambda m=module, v=vocab: export_drafter(m, v),
                                    folder, name, precision, backend,
                                    drafter_io(module.config, vocab, FLOAT.get(precision, "float32")),
                                    shared)
    entry = {"graphs": names, "num_modules": len(names), "source": source,
             "layer_config": drafter.config.to_dict(),
             **vocab_map_entry(drafter.d2t, folder, kind)}
    if method.fc_graph:
        fc = drafter.fc.fc
        graphs[method.fc_graph] = export_graph(lambda: export_fc(drafter.fc), folder,
                                               method.fc_graph, precision, backend,
                                               fc_io(fc.in_features, fc.out_features,
                                                     FLOAT.get(precision, "float32")), shared)
        entry.update(fc_graph=method.fc_graph, feature_layers=list(drafter.feature_layers))
    return graphs, entry


def load_models(model: str, draft_layers: int = 0, draft_model: str | None = None,
                heads: dict[str, str] | None = None):
    """The torch modules an engine folder is made of -> (hf_dir, target, draft or None, the
    draft's description, {kind: Drafter}). The target's eagle3_layers follow an Eagle3 head's
    feature layers. Export and the torch-cuda backend load through this one function."""
    if draft_layers and draft_model:
        raise ValueError("give either --draft-layers (a self-draft) or --draft-model, not both")
    hf_dir = resolve_model(model)
    log(f"loading {hf_dir}")
    target, config = load_target(hf_dir)
    draft, kind = None, None
    if draft_layers:
        draft = truncated_draft(target, draft_layers)
        kind = f"self-draft: the target's first {draft_layers} of {config.num_layers} layers"
    elif draft_model and is_draft_folder(draft_model):
        draft = load_draft(draft_model, target)
        kind = f"trained draft {draft_model} ({draft.config.num_layers} layers, the target's embedding)"
    elif draft_model:
        draft, _ = load_target(resolve_model(draft_model))
        kind = f"draft model {draft_model}"
        if draft.config.vocab_size != config.vocab_size:
            raise ValueError(f"draft model {draft_model!r} has vocab {draft.config.vocab_size}, "
                             f"the target {config.vocab_size}: a vanilla draft must share it")
    loaded = {}
    for head_kind, path in (heads or {}).items():
        log(f"loading the {head_kind} drafter from {path}")
        loaded[head_kind] = load_drafter(path, head_kind, target).eval()
    if "eagle3" in loaded and loaded["eagle3"].feature_layers != config.eagle3_layers:
        # the target's eagle3_features output follows the head's layers
        target.config = dataclasses.replace(config, eagle3_layers=loaded["eagle3"].feature_layers)
    return hf_dir, target, draft, kind, loaded


def portable(value: str | None, folder: Path) -> str | None:
    """A model or drafter as the manifest's "source" records it: a local path (a file or
    folder that exists) relative to the engine folder, so that the folder can move with its
    checkpoints; a model name (or anything else) as given."""
    if not value or value in KNOWN_MODELS or not Path(value).exists():
        return value
    return relative_source_path(value, folder)


def export_engine(model: str, out: Path, precision: str = "fp32", backend: str = "ort",
                  force: bool = False, draft_layers: int = 0, draft_model: str | None = None,
                  heads: dict[str, str] | None = None, draft_vocab: str | None = None) -> Path:
    """Exports the target (and a vanilla draft: `draft_layers` of the target itself, or a
    separate `draft_model` with the same vocabulary; and `heads` {"mtp" | "eagle" | "eagle3":
    checkpoint folder}) into the engine folder `out`. `draft_vocab` (resolve_draft_vocab):
    the vocabulary the vanilla draft's and MTP / Eagle heads draft over."""
    heads = {k: str(v) for k, v in (heads or {}).items() if v}
    unknown = sorted(set(heads) - set(KINDS))
    if unknown:
        raise ValueError(f"drafters {unknown} are not known; known: {', '.join(KINDS)}")
    draft_vocab = resolve_draft_vocab(draft_vocab, heads)
    if backend not in BACKENDS:
        raise ValueError(f"backend {backend!r} is not supported; choose from {BACKENDS}")
    if precision not in PRECISIONS[backend]:
        raise ValueError(f"precision {precision!r} is not supported for backend {backend!r}; "
                         f"choose from {PRECISIONS[backend]}")
    if draft_layers and draft_model:
        raise ValueError("give either --draft-layers (a self-draft) or --draft-model, not both")
    out = Path(out)
    # local paths relative to the folder (runtime/manifest.py source_path reads them back)
    source = {"model": portable(model, out), "precision": precision, "backend": backend,
              "lowering": LOWERING_VERSION,
              "draft_layers": draft_layers, "draft_model": portable(draft_model, out),
              "heads": {k: portable(v, out) for k, v in heads.items()},
              "draft_vocab": draft_vocab}
    if not force and (out / MANIFEST).exists():
        try:
            existing = load_manifest(out, verify="size")
            if existing.data.get("source") == source:
                log(f"{out} is up to date (use --force to export again)")
                return out
        except ValueError:
            pass  # corrupt or old: export again
    t0 = time.time()
    hf_dir, target, draft, kind, loaded = load_models(model, draft_layers, draft_model, heads)
    d2t = restrict_heads(draft_vocab, draft, loaded)
    if d2t is not None:
        log(f"drafting over the {draft_vocab} draft vocabulary ({len(d2t)} of "
            f"{target.config.vocab_size} tokens) in the vanilla, mtp and eagle heads")
    config, drafters = target.config, {}
    if precision == "int8-rows":  # exact in fp32: only what the 8-bit rows see changes
        from trt_spec.export.smooth import calibration_sequences, input_maxima, smooth
        n = smooth(target, input_maxima(target, calibration_sequences(hf_dir, progress=log)))
        log(f"  {n} MatMul inputs smoothed (their channel scales moved into the weights)")
    if precision == "fp16":  # TensorRT builds strongly typed: the graph's dtypes are its precision
        for module in [target, draft]:
            if module is not None:
                module.half()
        for drafter in loaded.values():
            for module in drafter.modules + ([drafter.fc] if drafter.fc is not None else []):
                module.half()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.tmp"))
    shared: dict[str, tuple[str, int, int]] = {}  # bytes written once for the whole folder
    try:
        dtype = FLOAT.get(precision, "float32")
        graphs = {"target": export_graph(lambda: export_target(target), tmp,
                                         "target", precision, backend, target_io(config, dtype),
                                         shared)}
        if backend == "trt":  # the score step returns tokens: SpecVerify inside the graph
            graphs["score"] = export_graph(lambda: export_score(target), tmp, "score", precision,
                                           backend, score_io(config, dtype), shared)
        if draft is not None:
            name = METHODS["vanilla"].graphs()[0]
            graphs[name] = export_graph(lambda: export_target(draft), tmp, name,
                                        precision, backend,
                                        target_io(draft.config, dtype, head_vocab(draft)),
                                        shared)
            drafters["vanilla"] = {"graph": name, "kind": kind,
                                   "model_config": draft.config.to_dict(),
                                   **vocab_map_entry(d2t, tmp, "vanilla")}
        for head_kind, drafter in loaded.items():
            head_graphs, drafters[head_kind] = export_drafter_graphs(
                drafter, tmp, precision, backend, source["heads"][head_kind], shared)
            graphs.update(head_graphs)
        tokenizer_files = copy_tokenizer(hf_dir, tmp)
        write_manifest(tmp, {
            "name": out.name,
            "source": source,
            "model_config": config.to_dict(),
            "tokenizer": {"files": tokenizer_files},
            "graphs": graphs,
            "drafters": drafters,
        })
        tmp.chmod(0o755)
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    log(f"wrote {out} in {time.time() - t0:.0f} s")
    return out


def default_out(model: str) -> Path:
    """engines/<model name>: a .gguf's stem, a folder's or a known model's name."""
    return Path("engines") / (Path(model).stem if model.endswith(".gguf") else Path(model).name)


def export_model(model: str, out: str | Path | None = None, precision: str | None = None,
                 lower_for: str = "ort", force: bool = False, draft_layers: int = 0,
                 draft_model: str | None = None, mtp: str | None = None,
                 eagle: str | None = None, eagle3: str | None = None,
                 shipped_drafters: bool = True, draft_vocab: str | None = None) -> Path:
    """`trt-spec export`: export_engine with the command's defaults. With `shipped_drafters`,
    a known model's drafters shipped in drafters/<model>/ are exported too, each unless its
    own argument (or `draft_layers`, for the vanilla draft) names another; `precision`
    defaults to fp16 when lowering for TensorRT, else int4; `out` to engines/<model name>."""
    from trt_spec.export.checkpoint import shipped_drafters as shipped_for

    if shipped_drafters:
        shipped = shipped_for(model)
        mtp = mtp or shipped.get("mtp")
        eagle = eagle or shipped.get("eagle")
        eagle3 = eagle3 or shipped.get("eagle3")
        if not (draft_layers or draft_model) and "draft" in shipped:
            draft_model = str(shipped["draft"])
        if shipped:
            log(f"shipped drafters for {model}: {', '.join(sorted(shipped))}")
    if precision is None:
        precision = "fp16" if lower_for == "trt" else "int4"
    out = default_out(model) if out is None else Path(out)
    return export_engine(model, out, precision, lower_for, force, draft_layers, draft_model,
                         heads={"mtp": mtp and str(mtp), "eagle": eagle and str(eagle),
                                "eagle3": eagle3 and str(eagle3)},
                         draft_vocab=draft_vocab)
