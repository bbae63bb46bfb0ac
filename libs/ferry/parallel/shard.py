"""One rank's share of a loaded model: every MoE layer becomes an ExpertParallelMoE holding only the
routed experts its placement gives this rank (the others are dropped); attention, dense layers, the
router and the shared experts stay whole on every rank (attention is data-parallel)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from safetensors import safe_open

from ferry.model import LoadedModel
from ferry.model.layers import GatedMLP
from ferry.model.moe import MoE
from ferry.model.moe_ep import ExpertParallelMoE
from ferry.model.weights import tensor_locations
from ferry.parallel.placement import ExpertPlacement


def shard_experts(
    lm: LoadedModel, placement: ExpertPlacement, rank: int, group: dist.ProcessGroup | None = None
) -> list[ExpertParallelMoE]:
    """Replaces lm's MoE layers in place; -> the expert-parallel layers, first layer first."""
    if not lm.config.n_routed_experts:
        raise ValueError(f"ep_size: {lm.config.arch} has no routed experts to split across ranks")
    if placement.num_experts != lm.config.n_routed_experts:
        raise ValueError(f"placement: {placement.num_experts} experts, the model has {lm.config.n_routed_experts}")
    layers = []
    for layer in lm.model.model.layers:
        if isinstance(layer.mlp, MoE):
            layer.mlp = ExpertParallelMoE(layer.mlp, placement, rank, group)
            layers.append(layer.mlp)
    return layers


def expert_parallel_layers(lm: LoadedModel) -> list[tuple[int, ExpertParallelMoE]]:
    """(layer index, layer) of every expert-parallel MoE of a sharded model."""
    return [(i, layer.mlp) for i, layer in enumerate(lm.model.model.layers) if isinstance(layer.mlp, ExpertParallelMoE)]


def apply_placements(lm: LoadedModel, placements: list[ExpertPlacement], rank: int) -> int:
    """Between steps: each EP layer takes its new placement; experts this rank newly holds are read
    from the checkpoint, those it keeps are reused. -> experts loaded."""
    locations = tensor_locations(lm.path)
    loaded = 0
    layers = expert_parallel_layers(lm)
    assert len(placements) == len(layers)
    for (index, layer), placement in zip(layers, placements):
        have = dict(zip(layer.placement.slots[rank], layer.experts))
        local = []
        for expert in placement.slots[rank]:
            if expert not in have:
                have[expert] = _load_expert(lm, locations, index, expert, layer.experts[0])  # type: ignore[arg-type]
                loaded += 1
            local.append(have[expert])
        layer.set_placement(placement, local)
    return loaded


def _load_expert(lm: LoadedModel, locations: dict, layer: int, expert: int, like: GatedMLP) -> GatedMLP:
    weight = like.down_proj.weight
    module = GatedMLP(lm.config.hidden_size, lm.config.moe_intermediate_size).to(weight.device, weight.dtype)
    prefix = f"model.layers.{layer}.mlp.experts.{expert}."
    with torch.no_grad():
        for name, param in module.named_parameters():
            with safe_open(str(locations[prefix + name]), "pt") as f:
                param.copy_(f.get_tensor(prefix + name).to(param.dtype))
    module.fuse()
    if weight.device.type == "cpu":
        module.prepack()
    return module.eval()
