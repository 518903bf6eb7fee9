"""Trace the target module to ONNX (torch.onnx dynamo exporter) with named, symbolic axes."""

from __future__ import annotations

import dataclasses
import gc
import hashlib
import warnings
from pathlib import Path

import onnx
import torch
from onnx import numpy_helper

from trt_spec.export.drafters import head_vocab
from trt_spec.export.model import TargetModel, empty_cache
from trt_spec.export.spill import SPILL_BYTES, is_spilled, spill_model, tensor_bytes
from trt_spec.runtime.config import ModelConfig
from trt_spec.runtime.graph_io import kv_names as layer_kv_names

# The same symbols as the shape comments, the manifest and the runtime.
BATCH, NEW_TOKENS, NUM_LOGITS, MAX_LEN = "batch", "new_tokens", "num_logits", "max_len"


def kv_names(config: ModelConfig, prefix: str) -> list[str]:
    return layer_kv_names(config.num_layers, prefix)


def target_io(config: ModelConfig, dtype: str = "float32",
              head_vocab: int | None = None) -> tuple[list[dict], list[dict]]:
    """Input and output specs of the target graph, as the manifest records them. dtype: of
    the float tensors (caches, logits, hidden states): "float32" or "float16". head_vocab:
    the logits' width when the head is restricted (a vanilla draft's); default the vocab."""
    kv_shape = [BATCH, config.num_kv_heads, MAX_LEN, config.head_dim]
    inputs = [
        {"name": "input_ids", "dtype": "int64", "shape": [BATCH, NEW_TOKENS]},
        {"name": "position_ids", "dtype": "int64", "shape": [BATCH, NEW_TOKENS]},
        {"name": "seqlens_k", "dtype": "int32", "shape": [BATCH]},
        {"name": "query_seqlens", "dtype": "int32", "shape": [BATCH]},
        {"name": "total_sequence_length", "dtype": "int32", "shape": []},
        {"name": "logits_index", "dtype": "int64", "shape": [BATCH, NUM_LOGITS]},
    ] + [{"name": n, "dtype": dtype, "shape": kv_shape}
         for n in kv_names(config, "past_key_values")]
    outputs = [
        {"name": "logits", "dtype": dtype,
         "shape": [BATCH, NUM_LOGITS, head_vocab or config.vocab_size]},
        {"name": "hidden_states", "dtype": dtype, "shape": [BATCH, NEW_TOKENS, config.hidden_size]},
        {"name": "eagle3_features", "dtype": dtype,
         "shape": [BATCH, NEW_TOKENS, len(config.eagle3_layers) * config.hidden_size]},
    ] + [{"name": n, "dtype": dtype, "shape": kv_shape} for n in kv_names(config, "present")]
    return inputs, outputs


def score_io(config: ModelConfig, dtype: str = "float32") -> tuple[list[dict], list[dict]]:
    """The target's score graph (export/model.py TargetScorer): the target's inputs without
    logits_index, plus the verifier's; SpecVerify's outputs instead of logits."""
    inputs, outputs = target_io(config, dtype)
    verify = [
        {"name": "seed", "dtype": "int64", "shape": [BATCH]},
        {"name": "position", "dtype": "int64", "shape": [BATCH]},
        {"name": "temperature", "dtype": "float32", "shape": [BATCH]},
        {"name": "top_k", "dtype": "int32", "shape": [BATCH]},
        {"name": "top_p", "dtype": "float32", "shape": [BATCH]},
    ]
    tokens = [{"name": "num_accepted", "dtype": "int64", "shape": [BATCH]},
              {"name": "tokens", "dtype": "int64", "shape": [BATCH, NEW_TOKENS]}]
    return inputs[:5] + verify + inputs[6:], tokens + outputs[1:]


def drafter_io(config: ModelConfig, head_vocab: int,
               dtype: str = "float32") -> tuple[list[dict], list[dict]]:
    """An MTP / Eagle / Eagle3 step graph: the target's inputs with one layer of past and a
    hidden state per new token; logits over `head_vocab` and the hidden state for the next."""
    inputs, outputs = target_io(dataclasses.replace(config, num_layers=1, eagle3_layers=(0,)),
                                dtype)
    hidden = {"name": "hidden_states", "dtype": dtype,
              "shape": [BATCH, NEW_TOKENS, config.hidden_size]}
    outputs = [
        {"name": "logits", "dtype": dtype, "shape": [BATCH, NUM_LOGITS, head_vocab]},
        {"name": "next_hidden_states", "dtype": dtype,
         "shape": [BATCH, NEW_TOKENS, config.hidden_size]},
    ] + outputs[3:]
    return inputs[:1] + [hidden] + inputs[1:], outputs


def fc_io(in_features: int, hidden_size: int,
          dtype: str = "float32") -> tuple[list[dict], list[dict]]:
    """Eagle3's fc: the target's fused features -> the head's first hidden state."""
    return ([{"name": "features", "dtype": dtype, "shape": [BATCH, NEW_TOKENS, in_features]}],
            [{"name": "hidden_states", "dtype": dtype,
              "shape": [BATCH, NEW_TOKENS, hidden_size]}])


def float_dtype(model: torch.nn.Module) -> torch.dtype:
    """The dtype of the module's weights: the export's float dtype (fp32, or fp16 for TRT)."""
    return next(model.parameters()).dtype


def dtype_name(dtype: torch.dtype) -> str:
    return {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}[dtype]


def export_target(model: TargetModel, path: Path | None = None,
                  spill: Path | None = None) -> onnx.ModelProto:
    """The traced target graph (also written to `path` + `path`.data when given). Sample
    sizes are all >= 2 so no dynamic axis is specialised to 0 or 1 by tracing. Float tensors
    take the model's dtype; logits the head's width (a vanilla draft's may be restricted).
    spill: the model's weights are let go and the graph's spilled there (export_module)."""
    config = model.config
    dtype = float_dtype(model)
    batch, new_tokens, max_len = 2, 3, 16
    args = (*step_args(batch, new_tokens, max_len), *empty_cache(config, batch, max_len, dtype))
    *dims, cache = step_dims(config)
    dynamic = (*dims, (cache,) * (2 * config.num_layers))  # *past: one tuple
    return export_module(model, args, dynamic,
                         *target_io(config, dtype_name(dtype), head_vocab(model)), path, spill)


def export_score(model: TargetModel, path: Path | None = None,
                 spill: Path | None = None) -> onnx.ModelProto:
    """The target's score graph (TargetScorer: target + SpecVerify), traced (spill: as
    export_target's)."""
    from trt_spec.export.model import TargetScorer

    config = model.config
    dtype = float_dtype(model)
    batch, new_tokens, max_len = 2, 3, 16
    ids, pos, seqlens, qlens, total, _ = step_args(batch, new_tokens, max_len)
    verify = (torch.arange(batch, dtype=torch.int64), torch.zeros(batch, dtype=torch.int64),
              torch.ones(batch), torch.zeros(batch, dtype=torch.int32), torch.ones(batch))
    args = (ids, pos, seqlens, qlens, total, *verify, *empty_cache(config, batch, max_len, dtype))
    ids_d, pos_d, seqlens_d, qlens_d, total_d, _, cache = step_dims(config)
    per_row = seqlens_d  # {0: batch}
    dynamic = (ids_d, pos_d, seqlens_d, qlens_d, total_d, per_row, per_row, per_row,
               per_row, per_row, (cache,) * (2 * config.num_layers))
    return export_module(TargetScorer(model), args, dynamic,
                         *score_io(config, dtype_name(dtype)), path, spill)


def export_drafter(model: torch.nn.Module, head_vocab: int,
                   path: Path | None = None) -> onnx.ModelProto:
    """An MTP module / Eagle / Eagle3 step (export/drafters.py), traced (and written to
    `path` when given)."""
    config = model.config
    dtype = float_dtype(model)
    batch, new_tokens, max_len = 2, 3, 16
    ids, *rest = step_args(batch, new_tokens, max_len)
    hidden = torch.zeros(batch, new_tokens, config.hidden_size, dtype=dtype)
    args = (ids, hidden, *rest, *empty_cache(config, batch, max_len, dtype))
    *dims, cache = step_dims(config)
    dynamic = (dims[0], dims[0], *dims[1:], cache, cache)  # hidden_states: as input_ids
    return export_module(model, args, dynamic,
                         *drafter_io(config, head_vocab, dtype_name(dtype)), path)


def export_fc(model: torch.nn.Module, path: Path | None = None) -> onnx.ModelProto:
    """Eagle3's fc, traced (and written to `path` when given)."""
    fc = model.fc
    dtype = float_dtype(model)
    b = torch.export.Dim("batch", min=1, max=1024)
    t = torch.export.Dim("new_tokens", min=1, max=1 << 16)
    return export_module(model, (torch.zeros(2, 3, fc.in_features, dtype=dtype),),
                         ({0: b, 1: t},),
                         *fc_io(fc.in_features, fc.out_features, dtype_name(dtype)), path)


def step_args(batch: int, new_tokens: int, max_len: int) -> tuple[torch.Tensor, ...]:
    """Sample step inputs (ids .. logits_index) for tracing; every size >= 2."""
    return (
        torch.zeros(batch, new_tokens, dtype=torch.int64),
        torch.arange(new_tokens).repeat(batch, 1),
        torch.full((batch,), new_tokens - 1, dtype=torch.int32),
        torch.full((batch,), new_tokens, dtype=torch.int32),
        torch.tensor(max_len, dtype=torch.int32),
        torch.zeros(batch, 2, dtype=torch.int64),
    )


def step_dims(config: ModelConfig) -> tuple:
    """Dynamic shapes of step_args, then a cache's: ({0: batch, 2: max_len}) last."""
    b = torch.export.Dim("batch", min=1, max=1024)
    t = torch.export.Dim("new_tokens", min=1, max=config.max_position_embeddings)
    n = torch.export.Dim("num_logits", min=1, max=config.max_position_embeddings)
    m = torch.export.Dim("max_len", min=2, max=config.max_position_embeddings)
    return ({0: b, 1: t}, {0: b, 1: t}, {0: b}, {0: b}, None, {0: b, 1: n}, {0: b, 2: m})


def export_module(model: torch.nn.Module, args: tuple, dynamic: tuple, inputs: list[dict],
                  outputs: list[dict], path: Path | None = None,
                  spill: Path | None = None) -> onnx.ModelProto:
    """Traces `model` with the dynamo exporter and checks its I/O against the contract;
    writes it to `path` when given. spill: the caller has no further use for `model`'s
    weights; they are let go once traced (release_weights), and the graph's large
    initializers are written to this scratch file one at a time instead of into the proto
    (export/spill.py), so that neither the module and the graph, nor the proto's arena, hold
    a 1B-8B model's fp32 weights (what ran out of memory)."""
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        program = torch.onnx.export(
            model, args, dynamic_shapes=dynamic, dynamo=True, optimize=True,
            input_names=[i["name"] for i in inputs], output_names=[o["name"] for o in outputs],
            verbose=False,
        )
    if spill is not None:
        program.exported_program = None  # it refers to the weights too
        release_weights(model)
        proto = spill_model(program.model, spill)
    else:
        proto = program.model_proto
    del program
    check_io(proto, inputs, outputs)
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        save_with_external_data(proto, path)
    return proto


def release_weights(module: torch.nn.Module) -> None:
    """Every parameter and buffer of `module` replaced by an empty one on the meta device (the
    module keeps its config and shapes): the tensors themselves are not touched, so whatever
    still refers to them (a traced graph) keeps them, and the rest is freed."""
    for sub in module.modules():
        for name, p in sub._parameters.items():
            if p is not None:
                sub._parameters[name] = torch.nn.Parameter(torch.empty_like(p, device="meta"),
                                                           requires_grad=p.requires_grad)
        for name, b in sub._buffers.items():
            if b is not None:
                sub._buffers[name] = torch.empty_like(b, device="meta")
    gc.collect()  # the tracer's objects refer to the weights through cycles


def check_io(proto: onnx.ModelProto, inputs: list[dict], outputs: list[dict]) -> None:
    got_in = [i.name for i in proto.graph.input]
    got_out = [o.name for o in proto.graph.output]
    want_in, want_out = [i["name"] for i in inputs], [o["name"] for o in outputs]
    if got_in != want_in or got_out != want_out:
        raise RuntimeError(f"exported graph I/O differs from the contract:\n"
                           f"inputs {got_in}\n!= {want_in}\noutputs {got_out}\n!= {want_out}")


def external_at(tensor: onnx.TensorProto, location: str, offset: int, length: int) -> None:
    """onnx's set_external_data (the same entries, in its order), also for a tensor whose
    bytes are not in the proto (spilled), then the proto's bytes cleared."""
    del tensor.external_data[:]
    tensor.data_location = onnx.TensorProto.EXTERNAL
    for key, value in (("location", location), ("offset", offset), ("length", length)):
        entry = tensor.external_data.add()
        entry.key, entry.value = key, str(value)
    tensor.ClearField("raw_data")


def save_with_external_data(proto: onnx.ModelProto, path: Path,
                            aliases: dict[str, str] | None = None,
                            shared: dict[str, tuple[str, int, int]] | None = None) -> list[str]:
    """Weights go to `<name>.data` beside the graph (page-aligned, so ORT can map them instead
    of parsing a 500 MB protobuf). `aliases` {name: source}: initializers that hold the same
    bytes as another (a reshaped view) point at the source's bytes instead of a copy.
    `shared` {sha256 of bytes: (file, offset, length)}: tensors already written beside earlier
    graphs of the folder (a drafter's copy of the target's embedding or head) point there; this
    graph's new tensors are added to it. Returns the files the graph reads besides itself."""
    aliases = aliases or {}
    data = path.with_name(path.name + ".data")
    tmp = data.with_name(data.name + ".partial")
    placed: dict[str, tuple[str, int, int]] = {}
    with open(tmp, "wb") as f:
        inits = sorted(proto.graph.initializer, key=lambda t: t.name in aliases)  # sources first
        for tensor in inits:
            if not tensor.HasField("raw_data") and not is_spilled(tensor):
                tensor.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(tensor), tensor.name))
            raw = tensor_bytes(tensor)  # a spilled tensor's from its scratch file
            if len(raw) < SPILL_BYTES and tensor.name not in aliases:
                continue
            digest = hashlib.sha256(raw).hexdigest() if shared is not None else None
            if tensor.name in aliases:
                location = placed[aliases[tensor.name]]
                assert location[2] == len(raw), (tensor.name, aliases[tensor.name])
            elif digest in (shared or {}):
                location = shared[digest]
            else:
                f.seek(-f.tell() % 4096, 1)  # align to a page
                location = (data.name, f.tell(), len(raw))
                f.write(raw)
                if shared is not None:
                    shared[digest] = location
            placed[tensor.name] = location
            external_at(tensor, *location)
            del raw
    onnx.save_model(proto, str(path))
    tmp.replace(data)
    return sorted({file for file, _, _ in placed.values()} - {data.name})
