"""The C++ kernel's column-blocked copy of a quantized weight (csrc/quant_linear.cpp), made once at load.

quant_ref's layout is row-major ([N, K] codes, as GGUF and the Triton kernel keep it); the CPU kernel wants,
for each input k, the codes of a block of output columns side by side, so one vector load feeds a whole
vector of outputs:
- int8: codes [N/16, K, 16] int8, scales [N/16, K/G, 16];
- int4: codes [N/32, K, 16] uint8 (low nibble: column j of the 32-column block, high nibble: column 16 + j),
  scales and offsets [N/32, K/G, 32] (offsets filled in as -8 * scale for symmetric weights).
N is padded to whole blocks with zero weights; the kernel writes only the real N columns.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ferry.kernels.quant_ref import QuantizedWeight, unpack_nibbles


@dataclass(slots=True)
class CpuPacked:
    codes: torch.Tensor
    """int8 [N/16, K, 16] or uint8 [N/32, K, 16]."""
    scales: torch.Tensor
    """fp32 [blocks, K/G, columns per block]."""
    offsets: torch.Tensor
    """fp32 like scales (int4), or an empty tensor (int8)."""
    bits: int
    group_size: int
    out_features: int
    """N before padding: the columns the kernel writes."""


def block_columns(bits: int) -> int:
    return 16 if bits == 8 else 32


def _blocked(t: torch.Tensor, cols: int) -> torch.Tensor:
    """[N, X] -> [ceil(N/cols), X, cols]: rows padded with zeros, each block transposed."""
    rows = t.shape[0]
    t = F.pad(t, (0, 0, 0, -rows % cols))
    return t.reshape(-1, cols, t.shape[1]).transpose(1, 2).contiguous()


def pack_for_cpu(qw: QuantizedWeight) -> CpuPacked:
    cols, rows, k = block_columns(qw.bits), qw.out_features, qw.in_features
    scales = _blocked(qw.scales, cols)
    if qw.bits == 8:
        codes = _blocked(qw.qweight, cols)
        return CpuPacked(codes, scales, torch.empty(0), 8, qw.group_size, rows)
    offsets = -8.0 * qw.scales if qw.offsets is None else qw.offsets
    u = _blocked(unpack_nibbles(qw.qweight, qw.group_size).reshape(rows, k), cols)  # [blocks, K, 32]
    codes = (u[..., :16] | (u[..., 16:] << 4)).contiguous()
    return CpuPacked(codes, scales, _blocked(offsets, cols), 4, qw.group_size, rows)
