"""Random weights for `ferry make-model` and writing them as (sharded) safetensors."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn


def random_state_dict(model: nn.Module, generator: torch.Generator, std: float) -> dict[str, torch.Tensor]:
    """Norm weights 1, everything else N(0, std). A tied weight appears once."""
    tensors = {}
    for name, param in model.named_parameters(remove_duplicate=True):
        if name.endswith("norm.weight"):
            value = torch.ones(param.shape)
        else:  # matrices, biases and the routing bias alike, so every term is exercised
            value = torch.randn(param.shape, generator=generator) * std
        tensors[name] = value.contiguous()
    return tensors


def save_state_dict(tensors: dict[str, torch.Tensor], out_dir: Path, max_shard_mb: float = 0.0) -> None:
    metadata = {"format": "pt"}
    if max_shard_mb <= 0:
        save_file(tensors, str(out_dir / "model.safetensors"), metadata=metadata)
        return
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, value in tensors.items():
        nbytes = value.numel() * value.element_size()
        if shards[-1] and size + nbytes > max_shard_mb * 2**20:
            shards.append({})
            size = 0
        shards[-1][name] = value
        size += nbytes
    weight_map = {}
    for i, shard in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(out_dir / file), metadata=metadata)
        weight_map.update({name: file for name in shard})
    total = sum(v.numel() * v.element_size() for v in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
