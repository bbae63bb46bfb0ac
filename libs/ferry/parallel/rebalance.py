"""Rebalancer: EPLB applied to a running rank between steps.

Each EP layer counts the tokens its router sent to every expert; after every step those counts go
into a sliding window per layer. Every `every_steps` steps the windows are summed over the group
(one all-reduce), every rank computes the same placement from the same numbers (the policy is
deterministic), and experts a rank newly holds are loaded before the next step begins.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ferry.model import LoadedModel
from ferry.parallel.eplb import EplbConfig, ExpertLoadWindow, hierarchical_placement
from ferry.parallel.placement import ExpertPlacement
from ferry.parallel.shard import apply_placements, expert_parallel_layers


def initial_placement(num_experts: int, num_groups: int, ep_size: int, config: EplbConfig) -> ExpertPlacement:
    """The placement before any load is known: even load, the spare slots as copies."""
    slots = num_experts // ep_size + config.redundant_slots_per_rank
    return hierarchical_placement([1.0] * num_experts, ep_size, slots, num_groups, config.num_nodes)


class Rebalancer:
    def __init__(self, lm: LoadedModel, rank: int, config: EplbConfig, group: dist.ProcessGroup | None = None) -> None:
        self.lm, self.rank, self.config, self.group = lm, rank, config, group
        self.layers = [layer for _, layer in expert_parallel_layers(lm)]
        self.windows = [ExpertLoadWindow(lm.config.n_routed_experts, config.window_steps) for _ in self.layers]
        self.num_steps = self.num_rebalances = self.num_experts_loaded = 0

    def after_step(self) -> bool:
        """Records this step's counts; re-places experts when it is time. -> whether it did."""
        for layer, window in zip(self.layers, self.windows):
            window.record(layer.expert_tokens.tolist())
            layer.expert_tokens.zero_()
        self.num_steps += 1
        if self.num_steps % self.config.every_steps:
            return False
        loads = torch.tensor([window.loads() for window in self.windows], dtype=torch.int64)  # [L, E]
        dist.all_reduce(loads, group=self.group)
        placement = self.layers[0].placement
        placements = [
            hierarchical_placement(
                row, placement.ep_size, placement.slots_per_rank, self.lm.config.n_group, self.config.num_nodes
            )
            for row in loads.tolist()
        ]
        self.num_experts_loaded += apply_placements(self.lm, placements, self.rank)
        self.num_rebalances += 1
        return True
