"""Reading HF safetensors checkpoints (single file or sharded with an index) into a module.

Every error names the file and the tensor: a missing shard, a missing tensor, a wrong shape.
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Set as AbstractSet
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


def tensor_locations(path: Path) -> dict[str, Path]:
    """-> {tensor name: file holding it}."""
    index = path / INDEX_FILE
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = {name: path / shard for name, shard in weight_map.items()}
        for shard in sorted(set(files.values())):
            if not shard.exists():
                raise FileNotFoundError(f"{shard}: shard listed in {index} is missing")
        return files
    shards = sorted(path.glob("*.safetensors"))
    if not shards:
        raise FileNotFoundError(f"{path / SINGLE_FILE}: no *.safetensors weights in {path}")
    files = {}
    for shard in shards:
        with safe_open(str(shard), "pt") as f:
            files.update({name: shard for name in f.keys()})
    return files


def load_weights(module: nn.Module, path: Path, skip: AbstractSet[str] = frozenset()) -> None:
    """Copies every parameter of module (a tied weight once) from the checkpoint at path."""
    locations = tensor_locations(path)
    targets = dict(module.named_parameters(remove_duplicate=True))
    by_file: dict[Path, list[str]] = {}
    for name in targets:
        if name in skip:
            continue
        if name not in locations:
            where = path / INDEX_FILE if (path / INDEX_FILE).exists() else path / SINGLE_FILE
            raise ValueError(f"{where}: missing tensor {name!r}")
        by_file.setdefault(locations[name], []).append(name)
    for file, names in by_file.items():
        with safe_open(str(file), "pt") as f:
            for name in names:
                _copy(targets[name], f.get_tensor(name), file, name)


def _copy(target: torch.Tensor, source: torch.Tensor, file: Path, name: str) -> None:
    if tuple(source.shape) != tuple(target.shape):
        raise ValueError(f"{file}: tensor {name!r} has shape {tuple(source.shape)}, expected {tuple(target.shape)}")
    if not (source.is_floating_point() and source.element_size() >= 2):
        raise ValueError(f"{file}: tensor {name!r} has unsupported dtype {source.dtype}")
    with torch.no_grad():
        target.copy_(source.to(target.dtype))


def weights_digest(path: Path) -> str:
    """A cheap content digest: every file's safetensors header plus 64 KiB from each end of its data,
    enough to tell two random checkpoints with the same config apart without hashing gigabytes."""
    digest = hashlib.sha256()
    for file in sorted(path.glob("*.safetensors")):
        with open(file, "rb") as f:
            header_len = struct.unpack("<Q", f.read(8))[0]
            digest.update(f.read(header_len))
            digest.update(f.read(65536))
            size = file.stat().st_size
            f.seek(max(8 + header_len, size - 65536))
            digest.update(f.read())
    return digest.hexdigest()[:16]
