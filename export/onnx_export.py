"""Trace the target module to ONNX (torch.onnx dynamo exporter) with named, symbolic axes."""

from __future__ import annotations

import warnings
from pathlib import Path

import onnx
import torch
from onnx import numpy_helper
from onnx.external_data_helper import set_external_data

from trt_spec.export.model import TargetModel, empty_cache
from trt_spec.runtime.config import ModelConfig

# The same symbols as the shape comments, the manifest and the runtime.
BATCH, NEW_TOKENS, NUM_LOGITS, MAX_LEN = "batch", "new_tokens", "num_logits", "max_len"


def kv_names(config: ModelConfig, prefix: str) -> list[str]:
    return [f"{prefix}.{i}.{kind}" for i in range(config.num_layers) for kind in ("key", "value")]


def target_io(config: ModelConfig) -> tuple[list[dict], list[dict]]:
    """Input and output specs of the target graph, as the manifest records them."""
    kv_shape = [BATCH, config.num_kv_heads, MAX_LEN, config.head_dim]
    inputs = [
        {"name": "input_ids", "dtype": "int64", "shape": [BATCH, NEW_TOKENS]},
        {"name": "position_ids", "dtype": "int64", "shape": [BATCH, NEW_TOKENS]},
        {"name": "seqlens_k", "dtype": "int32", "shape": [BATCH]},
        {"name": "query_seqlens", "dtype": "int32", "shape": [BATCH]},
        {"name": "total_sequence_length", "dtype": "int32", "shape": []},
        {"name": "logits_index", "dtype": "int64", "shape": [BATCH, NUM_LOGITS]},
    ] + [{"name": n, "dtype": "float32", "shape": kv_shape}
         for n in kv_names(config, "past_key_values")]
    outputs = [
        {"name": "logits", "dtype": "float32", "shape": [BATCH, NUM_LOGITS, config.vocab_size]},
        {"name": "hidden_states", "dtype": "float32", "shape": [BATCH, NEW_TOKENS, config.hidden_size]},
        {"name": "eagle3_features", "dtype": "float32",
         "shape": [BATCH, NEW_TOKENS, len(config.eagle3_layers) * config.hidden_size]},
    ] + [{"name": n, "dtype": "float32", "shape": kv_shape} for n in kv_names(config, "present")]
    return inputs, outputs


def export_target(model: TargetModel, path: Path) -> None:
    """Writes `path` (+ `path`.data with the weights). Sample sizes are all >= 2 so no
    dynamic axis is specialised to 0 or 1 by tracing."""
    config = model.config
    batch, new_tokens, num_logits, max_len = 2, 3, 2, 16
    args = (
        torch.zeros(batch, new_tokens, dtype=torch.int64),
        torch.arange(new_tokens).repeat(batch, 1),
        torch.full((batch,), new_tokens - 1, dtype=torch.int32),
        torch.full((batch,), new_tokens, dtype=torch.int32),
        torch.tensor(max_len, dtype=torch.int32),
        torch.zeros(batch, num_logits, dtype=torch.int64),
        *empty_cache(config, batch, max_len),
    )
    b = torch.export.Dim("batch", min=1, max=1024)
    t = torch.export.Dim("new_tokens", min=1, max=config.max_position_embeddings)
    n = torch.export.Dim("num_logits", min=1, max=config.max_position_embeddings)
    m = torch.export.Dim("max_len", min=2, max=config.max_position_embeddings)
    dynamic = ({0: b, 1: t}, {0: b, 1: t}, {0: b}, {0: b}, None, {0: b, 1: n},
               ({0: b, 2: m},) * (2 * config.num_layers))  # *past: one tuple
    inputs, outputs = target_io(config)
    path.parent.mkdir(parents=True, exist_ok=True)
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        program = torch.onnx.export(
            model, args, dynamic_shapes=dynamic, dynamo=True, optimize=True,
            input_names=[i["name"] for i in inputs], output_names=[o["name"] for o in outputs],
            verbose=False,
        )
    proto = program.model_proto
    check_io(proto, inputs, outputs)
    save_with_external_data(proto, path)


def check_io(proto: onnx.ModelProto, inputs: list[dict], outputs: list[dict]) -> None:
    got_in = [i.name for i in proto.graph.input]
    got_out = [o.name for o in proto.graph.output]
    want_in, want_out = [i["name"] for i in inputs], [o["name"] for o in outputs]
    if got_in != want_in or got_out != want_out:
        raise RuntimeError(f"exported graph I/O differs from the contract:\n"
                           f"inputs {got_in}\n!= {want_in}\noutputs {got_out}\n!= {want_out}")


def save_with_external_data(proto: onnx.ModelProto, path: Path,
                            aliases: dict[str, str] | None = None) -> None:
    """Weights go to `<name>.data` beside the graph (page-aligned, so ORT can map them instead
    of parsing a 500 MB protobuf). `aliases` {name: source}: initializers that hold the same
    bytes as another (a reshaped view) point at the source's bytes instead of a copy."""
    aliases = aliases or {}
    data = path.with_name(path.name + ".data")
    tmp = data.with_name(data.name + ".partial")
    placed: dict[str, tuple[int, int]] = {}
    with open(tmp, "wb") as f:
        inits = sorted(proto.graph.initializer, key=lambda t: t.name in aliases)  # sources first
        for tensor in inits:
            if not tensor.HasField("raw_data"):
                tensor.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(tensor), tensor.name))
            if len(tensor.raw_data) < 1024 and tensor.name not in aliases:
                continue
            if tensor.name in aliases:
                source = aliases[tensor.name]
                offset, length = placed[source]
                assert length == len(tensor.raw_data), (tensor.name, source)
            else:
                f.seek(-f.tell() % 4096, 1)  # align to a page
                offset, length = f.tell(), len(tensor.raw_data)
                f.write(tensor.raw_data)
            placed[tensor.name] = (offset, length)
            set_external_data(tensor, data.name, offset, length)
            tensor.ClearField("raw_data")
            tensor.data_location = onnx.TensorProto.EXTERNAL
    onnx.save_model(proto, str(path))
    tmp.replace(data)
