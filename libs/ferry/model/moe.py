"""DeepSeek-V3 mixture of experts: sigmoid scores, a score-correction bias that steers selection
only, group-limited top-k, normalised weights times the routed scaling factor, plus shared experts."""

from __future__ import annotations

import torch
from torch import nn

from ferry.model.config import ModelConfig
from ferry.model.grouped_experts import GroupedExperts
from ferry.model.layers import GatedMLP


class Router(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(cfg.n_routed_experts, cfg.hidden_size))
        # a checkpoint tensor, never trained here: a Parameter so the loader fills it like any other
        self.e_score_correction_bias = nn.Parameter(torch.zeros(cfg.n_routed_experts), requires_grad=False)
        self.top_k, self.num_groups, self.topk_groups = cfg.num_experts_per_tok, cfg.n_group, cfg.topk_group
        self.normalise, self.scaling = cfg.norm_topk_prob, cfg.routed_scaling_factor

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, hidden] -> (expert ids [T, k], weights [T, k] float32)."""
        scores = (x.float() @ self.weight.float().t()).sigmoid()  # [T, E]
        choice = scores + self.e_score_correction_bias.float()
        tokens, experts = choice.shape
        grouped = choice.view(tokens, self.num_groups, experts // self.num_groups)
        group_scores = grouped.topk(2, dim=-1).values.sum(-1)  # [T, G]: a group's two best experts
        keep = torch.zeros_like(group_scores, dtype=torch.bool)
        keep.scatter_(1, group_scores.topk(self.topk_groups, dim=-1).indices, True)
        choice = grouped.masked_fill(~keep[:, :, None], float("-inf")).view(tokens, experts)
        ids = choice.topk(self.top_k, dim=-1).indices  # [T, k]
        weights = scores.gather(1, ids)
        if self.normalise:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return ids, weights * self.scaling


class MoE(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate = Router(cfg)
        self.experts = nn.ModuleList(
            GatedMLP(cfg.hidden_size, cfg.moe_intermediate_size) for _ in range(cfg.n_routed_experts)
        )
        self.shared_experts = (
            GatedMLP(cfg.hidden_size, cfg.moe_intermediate_size * cfg.n_shared_experts)
            if cfg.n_shared_experts
            else None
        )
        self.grouped: GroupedExperts | None = None

    def fuse(self) -> None:
        """After loading: the experts' weights become one stack (their parameters re-pointed at it)."""
        self.grouped = GroupedExperts.stack(self.experts, share=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, hidden]
        ids, weights = self.gate(x)
        out = self.routed(x, ids, weights)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out

    def routed(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """x [T, hidden], ids/weights [T, k] (the gate's choice) -> [T, hidden]: the routed experts' weighted
        sum, one grouped matmul with no host sync (grouped_experts.py)."""
        grouped = self.grouped or GroupedExperts.stack(self.experts)  # unfused (tests): stacked per call
        return grouped(x, ids, weights)
