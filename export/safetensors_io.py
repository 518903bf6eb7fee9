"""A checkpoint folder's safetensors, read: whole (read_safetensors) or a tensor at a time
(LazyTensors: plain reads, so an export holds one tensor of the checkpoint at a time)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

import torch


def safetensors_files(folder: Path) -> list[Path]:
    """The folder's weight files (model.safetensors, or those its index names)."""
    index = folder / "model.safetensors.index.json"
    if index.exists():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = ["model.safetensors"]
    for name in files:
        if not (folder / name).exists():
            raise FileNotFoundError(f"{folder / name} not found (weights of {folder})")
    return [folder / name for name in files]


def read_safetensors(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the folder, in memory."""
    from safetensors.torch import load_file

    state = {}
    for path in safetensors_files(folder):
        state.update(load_file(path))
    return state


# safetensors' dtype names -> torch's
SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16,
                      "BF16": torch.bfloat16, "I64": torch.int64, "I32": torch.int32,
                      "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
                      "BOOL": torch.bool}


class LazyTensors(Mapping):
    """A folder's safetensors as a read-only mapping {name: tensor} that reads a tensor from
    its file each time it is looked up: a 1B-8B checkpoint is never in memory whole, only the
    tensors the caller keeps (target_state_dict's fp32 ones). Plain reads, not a memory map:
    a mapped file's pages stay in the process's resident set once touched."""

    def __init__(self, folder: Path):
        self.where = {}  # name -> (file, dtype name, shape, start, end)
        for path in safetensors_files(folder):
            with open(path, "rb") as f:
                size = int.from_bytes(f.read(8), "little")
                header = json.loads(f.read(size))
            for name, info in header.items():
                if name != "__metadata__":
                    start, end = info["data_offsets"]
                    self.where[name] = (path, info["dtype"], info["shape"], 8 + size + start,
                                        8 + size + end)

    def __getitem__(self, key: str) -> torch.Tensor:
        path, dtype, shape, start, end = self.where[key]
        if dtype not in SAFETENSORS_DTYPES:
            raise ValueError(f"{path}: {key!r} has dtype {dtype}; supported: "
                             f"{', '.join(SAFETENSORS_DTYPES)}")
        data = bytearray(end - start)
        with open(path, "rb") as f:
            f.seek(start)
            if f.readinto(data) != len(data):
                raise ValueError(f"{path}: {key!r} is cut short (file truncated?)")
        if not data:
            return torch.empty(shape, dtype=SAFETENSORS_DTYPES[dtype])
        return torch.frombuffer(data, dtype=SAFETENSORS_DTYPES[dtype]).reshape(shape)

    def __iter__(self):
        return iter(self.where)

    def __len__(self) -> int:
        return len(self.where)
