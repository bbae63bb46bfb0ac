"""Triton varlen prefill attention over the paged cache (grouped-query attention).

Every sequence's new tokens sit back to back in one flat [T, H, D] query tensor (no padding); their
K/V are already written to the paged cache, so each program reads the sequence's whole context
(cached prefix plus this chunk) through its block table, causally masked with the context offset and
an optional sliding window. Grid: (sequence, query tile, head); tiles past a sequence's end exit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ferry.kernels.triton_decode import (
    _dot,
    _online_softmax_step,
    _pow2,
    check_block_size,
    check_caches,
    upcast_dots,
)


@triton.jit
def _prefill_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    tables_ptr,
    query_start_ptr,
    seq_lens_ptr,
    out_ptr,
    stride_qt,
    stride_qh,
    stride_kn,
    stride_ks,
    stride_kh,
    stride_vn,
    stride_vs,
    stride_vh,
    stride_tb,
    stride_ot,
    stride_oh,
    scale,
    window,
    GROUP: tl.constexpr,
    D: tl.constexpr,
    DV: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    UPCAST: tl.constexpr,
):
    b, tile, h = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    q_start = tl.load(query_start_ptr + b)
    q_len = tl.load(query_start_ptr + b + 1) - q_start
    if tile * BLOCK_M >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + b)
    ctx = seq_len - q_len
    kvh = h // GROUP
    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    d, dv, s = tl.arange(0, BLOCK_D), tl.arange(0, BLOCK_DV), tl.arange(0, BLOCK_SIZE)
    row_ok = rows < q_len
    q_pos = ctx + rows  # [BM]
    q = tl.load(
        q_ptr + (q_start + rows)[:, None] * stride_qt + h * stride_qh + d[None, :],
        mask=row_ok[:, None] & (d[None, :] < D),
        other=0.0,
    )  # [BM, BD]
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    last_pos = ctx + tl.minimum((tile + 1) * BLOCK_M, q_len) - 1
    first_pos = tl.where(window > 0, tl.maximum(ctx + tile * BLOCK_M - window + 1, 0), 0)
    for blk in range(first_pos // BLOCK_SIZE, last_pos // BLOCK_SIZE + 1):
        block_id = tl.load(tables_ptr + b * stride_tb + blk).to(tl.int64)
        k_pos = blk * BLOCK_SIZE + s  # [BS]
        in_seq = k_pos < seq_len
        k = tl.load(
            k_ptr + block_id * stride_kn + s[:, None] * stride_ks + kvh * stride_kh + d[None, :],
            mask=in_seq[:, None] & (d[None, :] < D),
            other=0.0,
        ).to(q.dtype)  # [BS, BD]; a cache of another dtype (bf16 under fp32) is converted on load
        scores = _dot(q, tl.trans(k), UPCAST) * scale  # [BM, BS]
        valid = (k_pos[None, :] <= q_pos[:, None]) & in_seq[None, :]
        valid = valid & ((window == 0) | (k_pos[None, :] > q_pos[:, None] - window))
        p, alpha, m, l = _online_softmax_step(scores, valid, m, l)
        v = tl.load(
            v_ptr + block_id * stride_vn + s[:, None] * stride_vs + kvh * stride_vh + dv[None, :],
            mask=in_seq[:, None] & (dv[None, :] < DV),
            other=0.0,
        ).to(q.dtype)  # [BS, BDV]
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, UPCAST)
    out = acc / tl.where(l == 0.0, 1.0, l)[:, None]
    tl.store(
        out_ptr + (q_start + rows)[:, None] * stride_ot + h * stride_oh + dv[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=row_ok[:, None] & (dv[None, :] < DV),
    )


def varlen_prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    max_query_len: int,
    scale: float,
    window: int | None = None,
) -> torch.Tensor:
    """q [T, H, D] (every sequence's new tokens, flat); caches [N, bs, Hkv, D|Dv] already holding this
    step's K/V; block_tables [B, M]; query_start_loc [B+1]; seq_lens [B] -> [T, H, Dv]."""
    if q.dim() != 3 or q.stride(-1) != 1:
        raise ValueError(f"q: need [T, H, D] with unit last stride, got {tuple(q.shape)}")
    check_caches(q, [k_cache, v_cache])
    check_block_size(k_cache)
    batch = seq_lens.shape[0]
    if tuple(query_start_loc.shape) != (batch + 1,) or block_tables.shape[0] != batch:
        raise ValueError(
            f"query_start_loc {tuple(query_start_loc.shape)} / block_tables "
            f"{tuple(block_tables.shape)}: need [B+1] / [B, M] for B={batch}"
        )
    tokens, heads, dim = q.shape
    kv_heads, dim_v = k_cache.shape[2], v_cache.shape[-1]
    if heads % kv_heads or k_cache.shape[-1] != dim or block_tables.stride(-1) != 1:
        raise ValueError(f"k_cache {tuple(k_cache.shape)} does not fit q {tuple(q.shape)}")
    out = q.new_empty(tokens, heads, dim_v)
    if tokens == 0:
        return out
    block_m = 16 if max_query_len <= 16 else 32
    grid = (batch, triton.cdiv(max_query_len, block_m), heads)
    _prefill_kernel[grid](
        q,
        k_cache,
        v_cache,
        block_tables,
        query_start_loc,
        seq_lens,
        out,
        q.stride(0),
        q.stride(1),
        *k_cache.stride()[:3],
        *v_cache.stride()[:3],
        block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        scale,
        window or 0,
        GROUP=heads // kv_heads,
        D=dim,
        DV=dim_v,
        BLOCK_M=block_m,
        BLOCK_D=_pow2(dim),
        BLOCK_DV=_pow2(dim_v),
        BLOCK_SIZE=k_cache.shape[1],
        UPCAST=upcast_dots(q.dtype),
    )
    return out
