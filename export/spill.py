"""A traced graph's weights spilled to a scratch file while it is quantized and written.

protobuf (upb) keeps every byte a message ever held in its arena until the message is
dropped: a 1B-8B model's fp32 weights inside the traced ModelProto stay in memory through
quantization and saving, whatever is cleared. So the graph is serialized with each large
initializer written to a scratch file beside the engine folder's graphs instead (an external
tensor whose location is that file's absolute path), one tensor at a time, and read back
from it one matrix at a time:

    traced ir.Model --spill_model--> ModelProto (no large weights)  +  .<graph>.spill file
    quantize: tensor_array(init)        reads one weight from the file
    save_with_external_data: tensor_bytes(init) copies its bytes into <graph>.onnx.data

The scratch file is removed once the graph is saved (export/pipeline.py export_graph).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
from onnx import helper, numpy_helper

# Initializers of at least this many bytes are spilled: the same bound under which
# save_with_external_data keeps a tensor inside the graph, so that none stays external to a
# scratch file.
SPILL_BYTES = 1024


def spill_file(folder: Path, name: str) -> Path:
    """The scratch file of graph `name` in `folder` (hidden: never an engine file)."""
    return folder / f".{name}.spill"


def spill_model(model: ir.Model, path: Path) -> onnx.ModelProto:
    """ir.serde.serialize_model(model), every initializer of SPILL_BYTES or more written to
    `path` (page-aligned) and left in the proto as an external tensor there; each tensor is
    dropped from `model` once written, so whatever only the graph held (the weights of a
    module let go: onnx_export.release_weights) is freed as it goes."""
    path = Path(path).resolve()
    with open(path, "wb") as f:
        for value in model.graph.initializers.values():
            tensor = value.const_value
            if tensor is None or tensor.nbytes < SPILL_BYTES:
                continue
            f.seek(-f.tell() % 4096, 1)
            offset = f.tell()
            data = tensor.tobytes()
            f.write(data)
            value.const_value = ir.ExternalTensor(
                str(path), offset, len(data), tensor.dtype, shape=tensor.shape,
                name=tensor.name, doc_string=tensor.doc_string,
                metadata_props=dict(tensor.metadata_props))
            del tensor, data
    return ir.serde.serialize_model(model)


def is_spilled(tensor: onnx.TensorProto) -> bool:
    return tensor.data_location == onnx.TensorProto.EXTERNAL


def _where(tensor: onnx.TensorProto) -> tuple[str, int, int]:
    info = {e.key: e.value for e in tensor.external_data}
    return info["location"], int(info.get("offset", 0)), int(info["length"])


def tensor_bytes(tensor: onnx.TensorProto) -> bytes:
    """The tensor's raw bytes, from its scratch file if spilled."""
    if not is_spilled(tensor):
        return tensor.raw_data
    location, offset, length = _where(tensor)
    with open(location, "rb") as f:
        f.seek(offset)
        data = f.read(length)
    assert len(data) == length, (tensor.name, location, offset, length)
    return data


def tensor_array(tensor: onnx.TensorProto) -> np.ndarray:
    """numpy_helper.to_array(tensor), read from its scratch file if spilled (without filling
    the proto's raw_data: that would bring the bytes back into its arena)."""
    if not is_spilled(tensor):
        return numpy_helper.to_array(tensor)
    location, offset, length = _where(tensor)
    dtype = np.dtype(helper.tensor_dtype_to_np_dtype(tensor.data_type))
    return np.fromfile(location, dtype, length // dtype.itemsize,
                       offset=offset).reshape(tuple(tensor.dims))
