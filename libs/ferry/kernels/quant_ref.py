"""Group-wise quantized weights (int8, int4) and their plain-torch reference: quantize, dequantize, matmul.

A weight [N, K] is cut into groups of `group_size` consecutive input columns; each row's group has one
fp32 scale (and, for int4, optionally one fp32 offset):
- int8: qweight int8 [N, K], w = q * scale, q in -127..127 (symmetric, scale = absmax / 127).
- int4: qweight uint8 [N, K/2], two 4-bit codes u in 0..15 per byte, w = u * scale + offset. Quantized
  here symmetrically, offset = -8 * scale (llama.cpp's Q4_0 rule: the value of largest magnitude maps to
  -8), so offsets are not stored (offsets None); a GGUF Q4_1 tensor keeps its own offsets (its `m`).
  Within a group of G weights, byte j holds weight j in its low nibble and weight j + G/2 in its high
  nibble: a vector of low nibbles and the vector of high nibbles are then each G/2 consecutive weights.
Scales stay fp32: exact for GGUF's fp16 Q8_0/Q4_0 scales, so those load without a second rounding.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

BITS = (8, 4)
GROUP_SIZES = (32, 64, 128)
"""Supported group sizes: whole vectors of every kernel (int4 needs G/2 a multiple of 16 lanes)."""
DEFAULT_GROUP_SIZE = 32


@dataclass(slots=True)
class QuantizedWeight:
    qweight: torch.Tensor
    """int8 [N, K] codes (bits 8) or uint8 [N, K/2] nibble pairs (bits 4)."""
    scales: torch.Tensor
    """fp32 [N, K / group_size]."""
    offsets: torch.Tensor | None
    """fp32 [N, K / group_size] (int4 only), or None: symmetric, offset = -8 * scale."""
    bits: int
    """8 or 4."""
    group_size: int
    """Input columns per scale, one of GROUP_SIZES."""

    def __post_init__(self) -> None:
        if self.bits not in BITS:
            raise ValueError(f"bits: {self.bits}, expected one of {BITS}")
        if self.group_size not in GROUP_SIZES:
            raise ValueError(f"group_size: {self.group_size}, expected one of {GROUP_SIZES}")
        want = torch.int8 if self.bits == 8 else torch.uint8
        if self.qweight.dtype != want or self.qweight.dim() != 2:
            raise ValueError(f"qweight: {self.qweight.dtype} {tuple(self.qweight.shape)}, expected {want} [N, K]")
        rows, groups = self.out_features, self.in_features // self.group_size
        for name, t in (("scales", self.scales), ("offsets", self.offsets)):
            if t is not None and (t.dtype != torch.float32 or tuple(t.shape) != (rows, groups)):
                raise ValueError(f"{name}: {t.dtype} {tuple(t.shape)}, expected float32 [{rows}, {groups}]")
        if self.offsets is not None and self.bits != 4:
            raise ValueError("offsets: int8 weights are symmetric, offsets are for int4 only")

    @property
    def out_features(self) -> int:
        return self.qweight.shape[0]

    @property
    def in_features(self) -> int:
        return self.qweight.shape[1] * (8 // self.bits)

    def nbytes(self) -> int:
        tensors = (self.qweight, self.scales, self.offsets)
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def check_quantizable(weight: torch.Tensor, bits: int, group_size: int) -> None:
    if bits not in BITS or group_size not in GROUP_SIZES:
        raise ValueError(f"bits {bits}, group_size {group_size}: expected bits in {BITS}, group_size in {GROUP_SIZES}")
    if weight.dim() != 2 or weight.shape[1] % group_size:
        raise ValueError(f"weight {tuple(weight.shape)}: its input size is not a multiple of group_size {group_size}")


def quantize(weight: torch.Tensor, bits: int, group_size: int = DEFAULT_GROUP_SIZE) -> QuantizedWeight:
    """weight [N, K] (any float dtype) -> its symmetric group-wise quantization."""
    check_quantizable(weight, bits, group_size)
    rows, cols = weight.shape
    w = weight.detach().float().reshape(rows, cols // group_size, group_size)  # [N, groups, G]
    if bits == 8:
        scales = w.abs().amax(-1) / 127.0
        q = torch.round(w / _nonzero(scales)[..., None]).clamp_(-127, 127).to(torch.int8)
        return QuantizedWeight(q.reshape(rows, cols), scales.contiguous(), None, 8, group_size)
    # int4: the value of largest magnitude becomes -8 (full use of -8..7), as Q4_0 does
    extreme = w.gather(-1, w.abs().argmax(-1, keepdim=True))[..., 0]  # [N, groups], signed
    scales = extreme / -8.0  # may be negative: then the extreme is positive and still maps to code 0
    codes = (torch.round(w / _nonzero(scales)[..., None]) + 8).clamp_(0, 15).to(torch.uint8)
    return QuantizedWeight(pack_nibbles(codes, rows, cols), scales.contiguous(), None, 4, group_size)


def _nonzero(scales: torch.Tensor) -> torch.Tensor:
    return torch.where(scales == 0, torch.ones_like(scales), scales)


def pack_nibbles(codes: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """codes uint8 [N, groups, G] in 0..15 -> [N, K/2]: byte j of a group = code j | code (j + G/2) << 4."""
    half = codes.shape[-1] // 2
    return (codes[..., :half] | (codes[..., half:] << 4)).reshape(rows, cols // 2).contiguous()


def unpack_nibbles(qweight: torch.Tensor, group_size: int) -> torch.Tensor:
    """pack_nibbles' inverse: [N, K/2] -> codes uint8 [N, groups, G]."""
    rows = qweight.shape[0]
    packed = qweight.reshape(rows, -1, group_size // 2)
    return torch.cat([packed & 15, packed >> 4], dim=-1)


def dequantize(qw: QuantizedWeight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """-> the weight [N, K] the codes stand for."""
    rows, cols, group = qw.out_features, qw.in_features, qw.group_size
    scales = qw.scales[..., None]  # [N, groups, 1]
    if qw.bits == 8:
        w = qw.qweight.reshape(rows, cols // group, group).float() * scales
    else:
        offsets = -8.0 * scales if qw.offsets is None else qw.offsets[..., None]
        w = unpack_nibbles(qw.qweight, group).float() * scales + offsets
    return w.reshape(rows, cols).to(dtype)


def quant_matmul_ref(x: torch.Tensor, qw: QuantizedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ dequantize(qw).T (+ bias) -> [..., N] in x's dtype."""
    return F.linear(x, dequantize(qw, x.dtype), None if bias is None else bias.to(x.dtype))
