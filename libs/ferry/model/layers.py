"""Small building blocks shared by every architecture: RMSNorm and the SiLU-gated MLP."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ferry.kernels import rms_norm, silu_and_mul
from ferry.model.cpu_linear import FusedProjection, Linear


class RMSNorm(nn.Module):
    backend = "cpu"
    """One of ATTENTION_BACKENDS (CausalLM.set_attention_backend): 'cpu' uses the C++ op where it applies."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # normalise in fp32 whatever the weight dtype, as the reference implementations do
        return rms_norm(x, self.weight, self.eps, self.backend == "cpu")


def fuse_linears(*linears: nn.Linear) -> FusedProjection:
    """Concatenates the weights (and biases) of linears sharing an input into one matrix and re-points
    each linear's parameters at its slice, so one matmul serves all and no memory is duplicated."""
    weight = torch.cat([lin.weight.detach() for lin in linears])
    has_bias = linears[0].bias is not None
    bias = torch.cat([lin.bias.detach() for lin in linears]) if has_bias else None
    start = 0
    for lin in linears:
        end = start + lin.out_features
        lin.weight = nn.Parameter(weight[start:end], requires_grad=False)
        lin.is_fused = True  # type: ignore[assignment]  # a plain attribute, not a tensor or module
        if bias is not None:
            lin.bias = nn.Parameter(bias[start:end], requires_grad=False)
        start = end
    return FusedProjection(weight, bias)


class GatedMLP(nn.Module):
    """down(silu(gate(x)) * up(x))."""

    backend = "cpu"
    """As RMSNorm.backend (set with the attention layers')."""

    def __init__(self, hidden: int, intermediate: int, bias: bool = False) -> None:
        super().__init__()
        self.gate_proj = Linear(hidden, intermediate, bias=bias)
        self.up_proj = Linear(hidden, intermediate, bias=bias)
        self.down_proj = Linear(intermediate, hidden, bias=bias)
        self.gate_up: FusedProjection | None = None

    def fuse(self) -> None:
        if not self.gate_proj.is_fused:  # a MoE expert whose weights GroupedExperts already stacked
            self.gate_up = fuse_linears(self.gate_proj, self.up_proj)

    def prepack(self) -> None:
        if self.gate_up is not None:
            self.gate_up.prepack()

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, hidden]
        if self.gate_up is None:
            return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        bf16_forward = getattr(self.gate_up, "bf16_forward", None)  # a QuantLinear with a bf16 copy
        takes_bf16 = getattr(self.down_proj, "bf16_copy", None) is not None  # down multiplies bf16 rows too
        low = bf16_forward(x) if bf16_forward is not None and takes_bf16 else None
        if low is not None:  # a prefill step on AMX: gate/up -> SiLU -> down stays bf16 (quant_linear.BF16_ACTIVATIONS)
            return self.down_proj(silu_and_mul(low, self.backend == "cpu"))
        return self.down_proj(silu_and_mul(self.gate_up(x), self.backend == "cpu"))  # one matmul instead of two
