"""Triton matmul with group-wise int8 / int4 weights (the layout of quant_ref.py), dequantized in registers.

out [M, N] = x [M, K] @ W.T. Grid: (row tile, weight-row tile); each program walks K one quantization
group at a time: it loads the group's codes for BLOCK_N weight rows, widens and scales them (int4: the
low nibbles are the group's first half, the high nibbles its second half, so each half meets its own
slice of x), and accumulates tl.dot in fp32. On the CPU it runs only under TRITON_INTERPRET=1 (tests).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ferry.kernels.quant_ref import QuantizedWeight

BLOCK_M = 16
BLOCK_N = 32


@triton.jit
def _quant_matmul_kernel(
    x_ptr,
    q_ptr,
    scales_ptr,
    offsets_ptr,
    out_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_qn,
    stride_om,
    BITS: tl.constexpr,
    G: tl.constexpr,
    HAS_OFFSETS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BM]
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN] weight rows = output columns
    row_ok, col_ok = rows < M, cols < N
    groups = K // G
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for g in range(0, groups):
        scale = tl.load(scales_ptr + cols * groups + g, mask=col_ok, other=0.0)[None, :]  # [1, BN]
        if BITS == 8:
            k = tl.arange(0, G)
            x = tl.load(x_ptr + rows[:, None] * stride_xm + g * G + k[None, :], mask=row_ok[:, None], other=0.0)
            q = tl.load(q_ptr + cols[None, :] * stride_qn + g * G + k[:, None], mask=col_ok[None, :], other=0)
            w = q.to(tl.float32) * scale  # [G, BN]
            acc += tl.dot(x.to(tl.float32), w)
        else:
            half = tl.arange(0, G // 2)
            if HAS_OFFSETS:
                offset = tl.load(offsets_ptr + cols * groups + g, mask=col_ok, other=0.0)[None, :]
            else:
                offset = scale * -8.0
            b = tl.load(q_ptr + cols[None, :] * stride_qn + g * (G // 2) + half[:, None], mask=col_ok[None, :], other=0)
            b = b.to(tl.int32)
            w_lo = (b & 15).to(tl.float32) * scale + offset  # [G/2, BN]: the group's first half
            w_hi = (b >> 4).to(tl.float32) * scale + offset  # its second half
            x_base = x_ptr + rows[:, None] * stride_xm + g * G + half[None, :]
            x_lo = tl.load(x_base, mask=row_ok[:, None], other=0.0).to(tl.float32)
            x_hi = tl.load(x_base + G // 2, mask=row_ok[:, None], other=0.0).to(tl.float32)
            acc += tl.dot(x_lo, w_lo)
            acc += tl.dot(x_hi, w_hi)
    out = out_ptr + rows[:, None] * stride_om + cols[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


def triton_quant_matmul(x: torch.Tensor, qw: QuantizedWeight) -> torch.Tensor:
    """x [M, K] (fp32/bf16/fp16) -> [M, N] in x's dtype, accumulated in fp32."""
    if x.dim() != 2 or x.shape[1] != qw.in_features:
        raise ValueError(f"x: expected [M, {qw.in_features}], got {tuple(x.shape)}")
    tensors = (x, qw.qweight, qw.scales) + (() if qw.offsets is None else (qw.offsets,))
    if len({t.device for t in tensors}) != 1:
        raise ValueError("x and the quantized weight must be on one device")
    x = x.contiguous()
    m_rows, n_rows = x.shape[0], qw.out_features
    out = torch.empty(m_rows, n_rows, dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(m_rows, BLOCK_M), triton.cdiv(n_rows, BLOCK_N))
    _quant_matmul_kernel[grid](
        x,
        qw.qweight,
        qw.scales,
        qw.scales if qw.offsets is None else qw.offsets,  # unread without offsets
        out,
        m_rows,
        n_rows,
        qw.in_features,
        x.stride(0),
        qw.qweight.stride(0),
        out.stride(0),
        BITS=qw.bits,
        G=qw.group_size,
        HAS_OFFSETS=qw.offsets is not None,
        BLOCK_M=BLOCK_M,
        BLOCK_N=BLOCK_N,
    )
    return out
