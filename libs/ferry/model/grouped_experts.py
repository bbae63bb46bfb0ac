"""GroupedExperts: a MoE layer's routed experts as stacked weights, run as one grouped matmul with no
host synchronisation.

Each token's k (expert, weight) assignments are sorted by expert, so every expert's rows sit together;
the group ends (a cumulative count) stay on the device and a grouped GEMM (torch._grouped_mm) runs
each expert on its own rows. Nothing reads a count on the host: no .tolist()/.item(), no Python loop
whose length depends on the routing, so the step can be queued ahead (and captured in a CUDA graph).
torch._grouped_mm runs on the CPU in every dtype and on CUDA in bf16 on sm90+ with 16-byte aligned
rows; elsewhere (fp32/fp16 on CUDA, older cards) each expert multiplies every sorted row and keeps its
own, still without a sync (E times the FLOPs: a correctness fallback, not a fast path).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ferry.kernels import silu_and_mul


class GroupedExperts:
    """Experts' weights stacked: gate_up [E, 2I, H] (gate rows then up rows), down [E, H, I]."""

    def __init__(self, gate_up: torch.Tensor, down: torch.Tensor) -> None:
        self.gate_up, self.down = gate_up, down
        self.use_grouped_mm = _grouped_mm_supported(gate_up) and _grouped_mm_supported(down)
        self.backend = "cpu"
        """One of ATTENTION_BACKENDS (set by CausalLM.set_attention_backend through its MoE layer)."""

    @property
    def num_experts(self) -> int:
        return self.gate_up.shape[0]

    @classmethod
    def stack(cls, experts: Any, share: bool = False) -> GroupedExperts:  # GatedMLPs: an nn.ModuleList or a list
        """Stacks GatedMLP experts' weights. share=True (after loading) re-points each expert's
        parameters at its slice of the stack, so memory is not duplicated and the experts stay usable
        one by one; their own fuse/prepack then skip them (is_fused)."""
        gate_up = torch.stack([torch.cat([e.gate_proj.weight, e.up_proj.weight]).detach() for e in experts])
        down = torch.stack([e.down_proj.weight.detach() for e in experts])
        if share:
            inter = experts[0].gate_proj.out_features
            for i, expert in enumerate(experts):
                parts = (gate_up[i, :inter], gate_up[i, inter:], down[i])
                for lin, weight in zip((expert.gate_proj, expert.up_proj, expert.down_proj), parts):
                    lin.weight = nn.Parameter(weight, requires_grad=False)
                    lin.is_fused = True
        return cls(gate_up, down)

    def __call__(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """x [T, H], ids [T, k] expert ids, weights [T, k] -> [T, H]: each token's weighted sum over its
        k experts."""
        k = ids.shape[1]
        flat_ids = ids.flatten()  # [N = T*k]
        order = flat_ids.argsort(stable=True)  # [N] assignments grouped by expert
        rows = order // k  # [N] token row of each sorted assignment
        counts = torch.zeros(self.num_experts, dtype=torch.int64, device=x.device)
        counts.scatter_add_(0, flat_ids, torch.ones_like(flat_ids))  # bincount would sync for its size
        ends = counts.cumsum(0).to(torch.int32)  # [E] end of each expert's rows in the sorted order
        hidden = silu_and_mul(self._matmul(x[rows], self.gate_up, ends), self.backend == "cpu")  # [N, I]
        y = self._matmul(hidden, self.down, ends)  # [N, H]
        y = y * weights.flatten()[order, None].to(y.dtype)
        return torch.zeros_like(x).index_add_(0, rows, y)

    def _matmul(self, rows: torch.Tensor, weight: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
        """rows [N, in] sorted by expert, weight [E, out, in], ends [E] -> [N, out]."""
        if self.use_grouped_mm:
            return torch._grouped_mm(rows, weight.transpose(1, 2), offs=ends)
        expert_of_row = torch.searchsorted(ends, torch.arange(rows.shape[0], device=rows.device), right=True)
        out = rows.new_zeros(rows.shape[0], weight.shape[1])
        for e in range(self.num_experts):  # a fixed count, not the routing: every expert on every row
            out = torch.where((expert_of_row == e)[:, None], rows @ weight[e].t(), out)
        return out


def _grouped_mm_supported(weight: torch.Tensor) -> bool:
    if not hasattr(torch, "_grouped_mm"):
        return False
    if weight.device.type == "cpu":
        return True
    aligned = all(d * weight.element_size() % 16 == 0 for d in weight.shape[1:])
    return (
        weight.is_cuda
        and weight.dtype == torch.bfloat16
        and aligned
        and torch.cuda.is_available()
        and torch.cuda.get_device_capability(weight.device) >= (9, 0)
    )
