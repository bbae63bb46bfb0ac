"""Weight matmuls on the CPU through oneDNN, with each weight packed once at load.

torch's F.linear on the CPU goes to MKL, which on this project's CPU boxes (AMD EPYC) runs its AVX2
code and re-packs the weight on every call: a decode step's small-M matmuls then stream every
weight twice. oneDNN (bundled with torch as mkldnn) packs a weight once into its blocked layout and
runs AVX-512 kernels: measured on the 2-core box, 1 thread, bench-model shapes with the weights
coming from DRAM, 2.6x faster at 4 rows, 1.7x at 16 and 2.7x at 64; 214 vs 94 GFLOP/s at 1024^3.
The packed copy sits beside the plain weight (which stays for the reference path, tied embeddings
and state_dict), so CPU weights take twice the memory. FERRY_CPU_KERNELS=0 (the 'torch' backend) or a
torch without oneDNN means plain F.linear; so does a backend other than 'cpu' (each Linear holds the
model's, set once by CausalLM.set_attention_backend: no switch is read per call).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

PACKED_DTYPES = (torch.float32, torch.bfloat16)
PACK_HINT_ROWS = 16
"""oneDNN picks its packed layout for this many input rows; any row count works with it (measured: 16
was within noise of the best layout from 1 to 256 rows)."""


def pack(weight: torch.Tensor) -> torch.Tensor | None:
    """weight [out, in] -> oneDNN's packed copy, or None where it does not apply (GPU, fp16, no oneDNN)."""
    if weight.device.type != "cpu" or weight.dtype not in PACKED_DTYPES or not torch.backends.mkldnn.is_available():
        return None
    try:
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), PACK_HINT_ROWS)
    except (RuntimeError, AttributeError):  # an older or trimmed torch build: the plain path still works
        return None


def linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, packed: torch.Tensor | None
) -> torch.Tensor:
    """F.linear(x, weight, bias), through the packed weight when there is one. x [..., in] -> [..., out]."""
    if packed is None or x.dtype != weight.dtype or x.device.type != "cpu":
        return F.linear(x, weight, bias)
    out = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, x.shape[-1]), packed, bias, "none", [], "")
    return out.view(*x.shape[:-1], out.shape[-1])


class Linear(nn.Linear):
    """nn.Linear that, after prepack(), multiplies through its packed weight on the CPU."""

    packed: torch.Tensor | None = None
    backend = "cpu"
    """One of ATTENTION_BACKENDS: the packed weight is used under 'cpu' only."""
    is_fused: bool = False
    """Its weight is a slice of a FusedProjection, which does its matmuls: nothing to pack here."""

    def prepack(self) -> None:
        self.packed = None if self.is_fused else pack(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self.packed if self.backend == "cpu" else None)


class FusedProjection:
    """Several linears sharing an input as one matrix (fuse_linears' result); not a module, so the
    fused copy adds no parameters. Callable like a linear."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.weight, self.bias = weight, bias  # [sum of outs, in], [sum of outs]
        self.packed: torch.Tensor | None = None
        self.backend = "cpu"
        """As Linear.backend (set by CausalLM.set_attention_backend through the module holding it)."""

    def prepack(self) -> None:
        self.packed = pack(self.weight)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self.packed if self.backend == "cpu" else None)
