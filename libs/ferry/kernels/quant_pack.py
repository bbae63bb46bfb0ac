"""The C++ kernel's column-blocked copy of a quantized weight (csrc/quant_linear.cpp), made once at load.

quant_ref's layout is row-major ([N, K] codes, as GGUF and the Triton kernel keep it); the CPU kernel wants,
for each input k, the codes of a block of output columns side by side, so one vector load feeds a whole
vector of outputs:
- int8: codes [N/16, K, 16] int8, scales [N/16, K/G, 16];
- int4: codes [N/32, K, 16] uint8 (low nibble: column j of the 32-column block, high nibble: column 16 + j),
  scales and offsets [N/32, K/G, 32] (offsets filled in as -8 * scale for symmetric weights).
N is padded to whole blocks with zero weights; the kernel writes only the real N columns.

The int8-activation kernel (csrc/quant_dot.cpp) reads another copy, pack_for_dot's: 16 columns per block and
64 bytes per (block, 4 inputs) for int8 / (block, 8 inputs) for int4, so one load feeds 16 four-byte dots:
- int8: codes [N/16, K/4, 64] uint8, byte 4c + j = code (column c, input 4i + j) + 128;
- int4: codes [N/16, K/8, 64] uint8, byte 4c + j: low nibble (column c, input 8i + j), high (c, 8i + 4 + j);
- scales, offsets [N/16, K/G, 16] fp32 (int8's offsets are empty: the kernel takes the 128 off exactly).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ferry.kernels.quant_ref import QuantizedWeight, unpack_nibbles


@dataclass(slots=True)
class PackedWeight:
    """A quantized weight laid out for one CPU kernel; each subclass names the layout (module doc)."""

    codes: torch.Tensor
    scales: torch.Tensor
    """fp32, one per (column, group of G inputs), blocked like the codes."""
    offsets: torch.Tensor
    """fp32 like scales (int4), or an empty tensor (int8)."""
    bits: int
    group_size: int
    out_features: int
    """N before padding: the columns the kernel writes."""


@dataclass(slots=True)
class CpuPacked(PackedWeight):
    """The float kernel's copy (pack_for_cpu): codes int8 [N/16, K, 16] or uint8 [N/32, K, 16], scales
    [blocks, K/G, columns per block]."""


@dataclass(slots=True)
class DotPacked(PackedWeight):
    """The int8-activation kernel's copy (pack_for_dot): codes uint8 [N/16, K/4, 64] (int8) or
    [N/16, K/8, 64] (int4), scales [N/16, K/G, 16]."""


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


DOT_COLUMNS = 16


def pack_for_dot(qw: QuantizedWeight) -> DotPacked:
    rows, k = qw.out_features, qw.in_features
    scales = _blocked(qw.scales, DOT_COLUMNS)
    pad = -rows % DOT_COLUMNS
    if qw.bits == 8:
        biased = (qw.qweight.to(torch.int16) + 128).to(torch.uint8)  # [N, K]
        quads = F.pad(biased, (0, 0, 0, pad)).reshape(-1, DOT_COLUMNS, k // 4, 4)  # [blocks, 16, K/4, 4]
        codes = quads.transpose(1, 2).reshape(-1, k // 4, 64).contiguous()
        return DotPacked(codes, scales, torch.empty(0), 8, qw.group_size, rows)
    offsets = -8.0 * qw.scales if qw.offsets is None else qw.offsets
    u = F.pad(unpack_nibbles(qw.qweight, qw.group_size).reshape(rows, k), (0, 0, 0, pad))  # [N', K] in k order
    octets = u.reshape(-1, DOT_COLUMNS, k // 8, 2, 4)  # input 8i + 4h + j
    nibbles = octets[:, :, :, 0] | (octets[:, :, :, 1] << 4)  # [blocks, 16, K/8, 4]
    codes = nibbles.transpose(1, 2).reshape(-1, k // 8, 64).contiguous()
    return DotPacked(codes, scales, _blocked(offsets, DOT_COLUMNS), 4, qw.group_size, rows)
