"""`trt-spec export`: model -> engine folder (graphs, tokenizer, manifest), written atomically.

    export_model(ExportConfig("smollm2-135m"))   # export/config.py: what is exported

    the drafters shipped for a known model join config.drafters (with_shipped_drafters)
    -> models and drafters named on the hub fetched, named by their commit (with_hub_commits)
    -> the manifest's "source" for it; a folder with the same one is up to date
    -> the torch modules (load_models), the heads cut to the draft vocabulary, smoothed
       (int8-rows) or halved (fp16) (prepare_models)
    -> every graph traced, lowered, quantized and written to a temporary folder beside the
       engine folder with the tokenizer and the manifest, then renamed to it (write_folder)
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import NamedTuple

import numpy as np

from trt_spec.export.attention_rows import SPEC as ATTENTION_ROWS_SPEC
from trt_spec.export.attention_rows import pad_attention_rows
from trt_spec.export.checkpoint import KNOWN_MODELS, load_into, load_target, resolve_model
from trt_spec.export.config import (DRAFT_VOCABS, DRAFTER_METHODS, FULL_VOCAB, ExportConfig,
                                    resolve_draft_vocab)
from trt_spec.export.drafter_checkpoint import is_draft_folder, load_draft, load_drafter
from trt_spec.export.drafters import Drafter, head_vocab, restrict_head
from trt_spec.export.hub import local, local_folder, pin
from trt_spec.export.lean import unfuse_split_products
from trt_spec.export.model import TargetModel
from trt_spec.export.onnx_export import (drafter_io, export_drafter, export_fc, export_score,
                                         export_target, fc_io, save_with_external_data,
                                         score_io, target_io)
from trt_spec.export.quantize import embedding_int8, matmuls_to_nbits, tie_embedding_int8
from trt_spec.export.spill import spill_file
from trt_spec.plugins.lowering import lowering
from trt_spec.runtime.manifest import (MANIFEST, load_manifest, relative_source_path,
                                       write_manifest)
from trt_spec.runtime.methods import METHODS, by_train_name

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
# int4-plain, the lean form, rescores its top 16: on SmolLM2 its greedy agreement with fp32 is
# the same as at 128 (0.754 on 1,024 held-out positions) and its KL 0.304 against 0.291 (the
# 4-bit head alone: 0.362), for 0.3-2% of a decode step (docs/quantization.md, "The lean
# graph"). The faithful int4 keeps 128: its KL would double (0.0094 -> 0.0195).
HEAD_RESCORE = {"int4": 128, "int4-plain": 16, "int8-rows": 128}
# The precisions under which a GPTQ / AWQ checkpoint's own 4-bit codes are the body's weights
# (export/int4_checkpoint.py); the others quantize its dequantized weights again.
CHECKPOINT_CODES = ("int4", "int4-head8", "int4-plain")
# Bumped when a graph's lowering changes (weight forms, attention rows), so that `export`
# redoes folders made before.
LOWERING_VERSION = 6
# The quantized forms whose zero points are integers (no block-sum residual): a graph whose body
# holds only these is made as lean as onnxruntime-genai's (export/lean.py).
LEAN_FORMS = ("int4", "int4-checkpoint")

def restrict_heads(draft_vocab: str, draft, drafters: dict[str, Drafter]):
    """In place: the vanilla draft and the heads over the target's vocabulary (MTP, Eagle)
    keep only the rows of the draft vocabulary `draft_vocab` (resolve_draft_vocab: the method
    that lends its own, or FULL_VOCAB) -> its d2t [draft_vocab] int64, or None for
    FULL_VOCAB. The lender's head (Eagle3's) is already over it."""
    assert draft_vocab in DRAFT_VOCABS, draft_vocab
    if draft_vocab == FULL_VOCAB:
        return None
    d2t = drafters[draft_vocab].d2t
    for drafter in drafters.values():
        if drafter.d2t is None:
            for module in drafter.modules:
                restrict_head(module, d2t)
            drafter.d2t = d2t
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
                 shared: dict[str, tuple[str, int, int]] | None = None,
                 codes: dict | None = None) -> dict:
    """`trace()` returns a traced graph; it is lowered to `precision` here and written once,
    to `<name>.onnx` (+ .data) in `folder`, where tensors whose bytes an earlier graph of the
    folder already wrote (`shared`, see save_with_external_data) are read from there.
    `codes`: a GPTQ / AWQ checkpoint's (Models.codes), written unchanged under the int4
    precisions (CHECKPOINT_CODES). Returns its manifest entry."""
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
        n = matmuls_to_nbits(proto, FORMS[precision], errors=errors,
                             given=codes if precision in CHECKPOINT_CODES else None)
        log(f"  {n} MatMuls quantized"
            + (", embedding and lm_head share one int8 table" if tied else "")
            + (f" (the head: 4-bit, its top {rescore} rescored from it)"
               if tied and rescore else "")
            + (", embedding to int8" if tables else ""))
        if is_lean(errors):
            cut = unfuse_split_products(proto)
            log(f"  lean graph: {cut} fused products (gate/up) run as two MatMulNBits, no Split")
    inputs, outputs = io
    if backend == "ort" and pad_attention_rows(proto):  # exact decoding inside the graph
        inputs = inputs + [ATTENTION_ROWS_SPEC]
    others = save_with_external_data(proto, graph, aliases, shared)
    spill_file(folder, name).unlink(missing_ok=True)  # its weights, if spilled, are saved
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


def is_lean(errors: dict[str, tuple[str, float]]) -> bool:
    """Whether every quantized MatMul of the body (the 8-bit head aside) has integer zero
    points (LEAN_FORMS): then no node of the graph needs the fused products (export/lean.py)."""
    body = {form for form, _ in errors.values()} - {"int8"}
    return bool(body) and body <= set(LEAN_FORMS)


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


class Models(NamedTuple):
    """The torch modules an engine folder is made of."""

    hf_dir: Path  # the target's Hugging Face folder (its tokenizer)
    target: TargetModel
    draft: TargetModel | None  # the vanilla draft
    draft_kind: str | None  # what the vanilla draft is (its manifest entry's "kind")
    drafters: dict[str, Drafter]  # the heads, by method
    # a GPTQ / AWQ target's codes, by the content of the fused weight (int4_checkpoint.py
    # fused_codes); empty for a plain checkpoint
    codes: dict = {}


def load_vanilla(config: ExportConfig, target: TargetModel
                 ) -> tuple[TargetModel | None, str | None]:
    """The vanilla draft `config` names -> (the draft, what it is), or (None, None)."""
    layers, model, vocab = config.draft_layers, config.draft_model, target.config.vocab_size
    if layers:
        return truncated_draft(target, layers), (f"self-draft: the target's first {layers} of "
                                                 f"{target.config.num_layers} layers")
    path = local(model) if model else None  # a hub name: its snapshot's folder
    if path and is_draft_folder(path):
        draft = load_draft(path, target)
        return draft, (f"trained draft {model} ({draft.config.num_layers} layers, the target's "
                       "embedding)")
    if model:
        draft, _ = load_target(resolve_model(path))
        if draft.config.vocab_size != vocab:
            raise ValueError(f"draft model {model!r} has vocab {draft.config.vocab_size}, "
                             f"the target {vocab}: a vanilla draft must share it")
        return draft, f"draft model {model}"
    return None, None


def load_models(config: ExportConfig) -> Models:
    """The torch modules of the folder `config` describes. The target's eagle3_layers follow
    an Eagle3 head's feature layers. Export and the torch-cuda backend load through this one
    function."""
    hf_dir = resolve_model(config.model)
    log(f"loading {hf_dir}")
    target, model_config = load_target(hf_dir)
    draft, kind = load_vanilla(config, target)
    loaded = {}
    for method, path in config.heads.items():
        log(f"loading the {method} drafter from {path}")
        loaded[method] = load_drafter(local_folder(path, method), method, target).eval()
    if "eagle3" in loaded and loaded["eagle3"].feature_layers != model_config.eagle3_layers:
        # the target's eagle3_features output follows the head's layers
        target.config = dataclasses.replace(model_config,
                                            eagle3_layers=loaded["eagle3"].feature_layers)
    return Models(hf_dir, target, draft, kind, loaded, checkpoint_codes(hf_dir, model_config))


def checkpoint_codes(hf_dir: Path, config) -> dict:
    """A GPTQ / AWQ folder's codes for the target's fused weights ({} for a plain folder)."""
    from trt_spec.export.checkpoint import read_safetensors
    from trt_spec.export.int4_checkpoint import fused_codes, quantization_config, read_quantized

    qc = quantization_config(hf_dir, json.loads((hf_dir / "config.json").read_text()))
    if qc is None:
        return {}
    _, codes = read_quantized(read_safetensors(hf_dir), qc, str(hf_dir), config.attention_bias)
    log(f"{qc['quant_method']} checkpoint: {len(codes)} quantized modules, group size "
        f"{qc.get('group_size', qc.get('q_group_size'))}")
    return fused_codes(codes, config.num_layers, str(hf_dir))


def prepare_models(models: Models, precision: str, draft_vocab: str):
    """In place, before tracing: the heads cut to the draft vocabulary (restrict_heads), the
    target smoothed for int8-rows, every module halved for fp16 -> the draft vocabulary's
    d2t [draft_vocab] int64 (None: the full one)."""
    target, draft = models.target, models.draft
    d2t = restrict_heads(draft_vocab, draft, models.drafters)
    if d2t is not None:
        log(f"drafting over the {draft_vocab} draft vocabulary ({len(d2t)} of "
            f"{target.config.vocab_size} tokens) in the vanilla, mtp and eagle heads")
    if precision == "int8-rows":  # exact in fp32: only what the 8-bit rows see changes
        from trt_spec.export.smooth import calibration_sequences, input_maxima, smooth
        sequences = calibration_sequences(models.hf_dir, progress=log)
        n = smooth(target, input_maxima(target, sequences))
        log(f"  {n} MatMul inputs smoothed (their channel scales moved into the weights)")
    if precision == "fp16":  # TensorRT builds strongly typed: the graph's dtypes are its precision
        for module in [target, draft]:
            if module is not None:
                module.half()
        for drafter in models.drafters.values():
            for module in drafter.modules + ([drafter.fc] if drafter.fc is not None else []):
                module.half()
    return d2t


def export_graphs(models: Models, folder: Path, precision: str, backend: str,
                  head_sources: dict[str, str], d2t) -> tuple[dict, dict]:
    """Every graph of the folder (and the vocabulary maps) into `folder` -> (the manifest's
    "graphs", its "drafters"). head_sources: each head's "source" entry, by method."""
    target, draft, config = models.target, models.draft, models.target.config
    shared: dict[str, tuple[str, int, int]] = {}  # bytes written once for the whole folder
    dtype = FLOAT.get(precision, "float32")
    # The target's weights are let go once its last graph is traced, and that graph's spilled
    # to a scratch file, when no later graph reads the target (a drafter may share its
    # embedding): a 1B-8B model's fp32 weights held twice (module and graph) are what ran
    # out of memory (export_module's spill, export/spill.py).
    last = draft is None and not models.drafters
    score = backend == "trt"  # the score step returns tokens: SpecVerify inside the graph
    graphs = {"target": export_graph(
        lambda: export_target(target, spill=spill_file(folder, "target")
                              if last and not score else None),
        folder, "target", precision, backend, target_io(config, dtype), shared, models.codes)}
    if score:
        graphs["score"] = export_graph(
            lambda: export_score(target, spill=spill_file(folder, "score") if last else None),
            folder, "score", precision, backend, score_io(config, dtype), shared)
    drafters = {}
    if draft is not None:
        name = METHODS["vanilla"].graphs()[0]
        graphs[name] = export_graph(lambda: export_target(draft), folder, name, precision,
                                    backend, target_io(draft.config, dtype, head_vocab(draft)),
                                    shared)
        drafters["vanilla"] = {"graph": name, "kind": models.draft_kind,
                               "model_config": draft.config.to_dict(),
                               **vocab_map_entry(d2t, folder, "vanilla")}
    for method, drafter in models.drafters.items():
        head_graphs, drafters[method] = export_drafter_graphs(
            drafter, folder, precision, backend, head_sources[method], shared)
        graphs.update(head_graphs)
    return graphs, drafters


def write_folder(config: ExportConfig, source: dict, models: Models, d2t) -> None:
    """The graphs, the tokenizer and the manifest into a temporary folder beside config.out,
    then renamed to it (replacing the folder there)."""
    out = config.out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.tmp"))
    try:
        graphs, drafters = export_graphs(models, tmp, config.precision, config.lower_for,
                                         source["heads"], d2t)
        tokenizer_files = copy_tokenizer(models.hf_dir, tmp)
        write_manifest(tmp, {
            "name": out.name,
            "source": source,
            "model_config": models.target.config.to_dict(),
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


def portable(value: str | None, folder: Path) -> str | None:
    """A model or drafter as the manifest's "source" records it: a local path (a file or
    folder that exists) relative to the engine folder, so that the folder can move with its
    checkpoints; a model name, a pinned hub name (hf://org/name@<commit>) or anything else as
    given."""
    if not value or value in KNOWN_MODELS or not Path(value).exists():
        return value
    return relative_source_path(value, folder)


def source_entry(config: ExportConfig, draft_vocab: str) -> dict:
    """The manifest's "source": what the folder is made from, local paths relative to it
    (runtime/manifest.py source_path reads them back)."""
    out = config.out
    return {"model": portable(config.model, out), "precision": config.precision,
            "backend": config.lower_for, "lowering": LOWERING_VERSION,
            "draft_layers": config.draft_layers, "draft_model": portable(config.draft_model, out),
            "heads": {k: portable(v, out) for k, v in config.heads.items()},
            "draft_vocab": draft_vocab}


def up_to_date(out: Path, source: dict) -> bool:
    """Whether the engine folder `out` was exported from `source` (and is whole)."""
    if not (out / MANIFEST).exists():
        return False
    try:
        return load_manifest(out, verify="size").data.get("source") == source
    except ValueError:
        return False  # corrupt or old: export again


def with_shipped_drafters(config: ExportConfig) -> ExportConfig:
    """`config` plus the drafters trained for its model and shipped in drafters/<model>/ (a
    known model's; none for others), each where config names no other (draft_layers: a
    vanilla draft of its own)."""
    from trt_spec.export.checkpoint import shipped_drafters

    found = shipped_drafters(config.model)  # by train name
    if not found:
        return config
    log(f"shipped drafters for {config.model}: {', '.join(sorted(found))}")
    shipped = {by_train_name(name).name: path for name, path in found.items()}
    if config.draft_layers:
        shipped.pop("vanilla", None)
    return dataclasses.replace(config, drafters={
        m: config.drafters.get(m) or shipped.get(m) for m in DRAFTER_METHODS})


def with_hub_commits(config: ExportConfig) -> ExportConfig:
    """`config` with its model and drafters named on the hub (org/name[@revision]) fetched
    into the hub's cache and named by the commit fetched, hf://org/name@<commit>
    (export/hub.py pin): the manifest's "source" records exactly what was exported, and a
    new commit on the hub makes the folder out of date. Local paths and names stay."""
    return dataclasses.replace(config, model=pin(config.model),
                               drafters={m: pin(p) for m, p in config.drafters.items()})


def export_model(config: ExportConfig, force: bool = False) -> Path:
    """`trt-spec export`: the engine folder config.out made from `config` (with the drafters
    shipped for its model, where config.shipped_drafters), or left as it is when it was made
    from the same sources and settings (unless `force`). Returns config.out."""
    if config.shipped_drafters:
        config = with_shipped_drafters(config)
    config = with_hub_commits(config)
    draft_vocab = resolve_draft_vocab(config.draft_vocab, config.drafters)
    source = source_entry(config, draft_vocab)
    if not force and up_to_date(config.out, source):
        log(f"{config.out} is up to date (use --force to export again)")
        return config.out
    t0 = time.time()
    models = load_models(config)
    d2t = prepare_models(models, config.precision, draft_vocab)
    write_folder(config, source, models, d2t)
    log(f"wrote {config.out} in {time.time() - t0:.0f} s")
    return config.out
