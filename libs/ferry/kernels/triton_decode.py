"""Triton paged decode attention: one new token per sequence against its paged cache.

Two kernels: grouped-query attention (one program per sequence and KV head; the query heads sharing
that KV head are the rows of the tile) and MLA over the compressed latent (one program per sequence
and block of heads; each cached latent tile is loaded once and used as both key and value).
Both run an online softmax over the sequence's cache blocks. Wrappers check shapes and strides first.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"
"""The kernels run in Triton's CPU interpreter (read once, as triton.jit does when it wraps them)."""


def _pow2(n: int) -> int:
    return max(16, triton.next_power_of_2(n))  # tl.dot wants every tile dim >= 16


def upcast_dots(dtype: torch.dtype) -> bool:
    """The interpreter multiplies bf16 tiles wrongly (numpy has no bf16); there the dots take the same
    bf16 values widened to fp32 (exact), so the CPU proof covers everything but the bf16 MMA itself."""
    return INTERPRETED and dtype == torch.bfloat16


@triton.jit
def _dot(a, b, UPCAST: tl.constexpr):
    if UPCAST:
        a, b = a.to(tl.float32), b.to(tl.float32)
    return tl.dot(a, b, input_precision="ieee")


@triton.jit
def _online_softmax_step(scores, valid, m, l):
    """scores [R, S] with invalid entries masked -> (p, alpha, new m, new l); safe when a row is empty."""
    scores = tl.where(valid, scores, float("-inf"))
    m_new = tl.maximum(m, tl.max(scores, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp(scores - m_safe[:, None])
    alpha = tl.exp(m - m_safe)
    return p, alpha, m_new, l * alpha + tl.sum(p, 1)


@triton.jit
def _gqa_decode_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    tables_ptr,
    seq_lens_ptr,
    out_ptr,
    stride_qb,
    stride_qh,
    stride_kn,
    stride_ks,
    stride_kh,
    stride_vn,
    stride_vs,
    stride_vh,
    stride_tb,
    stride_ob,
    stride_oh,
    scale,
    window,
    GROUP: tl.constexpr,
    D: tl.constexpr,
    DV: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    UPCAST: tl.constexpr,
):
    b, kvh = tl.program_id(0), tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + b)
    g, d, dv, s = tl.arange(0, BLOCK_G), tl.arange(0, BLOCK_D), tl.arange(0, BLOCK_DV), tl.arange(0, BLOCK_SIZE)
    heads = kvh * GROUP + g
    q = tl.load(
        q_ptr + b * stride_qb + heads[:, None] * stride_qh + d[None, :],
        mask=(g[:, None] < GROUP) & (d[None, :] < D),
        other=0.0,
    )  # [BG, BD]
    m = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_DV], tl.float32)
    q_pos = seq_len - 1
    first_pos = tl.where(window > 0, tl.maximum(q_pos - window + 1, 0), 0)
    for blk in range(first_pos // BLOCK_SIZE, tl.cdiv(seq_len, BLOCK_SIZE)):
        block_id = tl.load(tables_ptr + b * stride_tb + blk).to(tl.int64)
        pos = blk * BLOCK_SIZE + s
        valid = (pos < seq_len) & (pos >= first_pos)
        k = tl.load(
            k_ptr + block_id * stride_kn + s[:, None] * stride_ks + kvh * stride_kh + d[None, :],
            mask=valid[:, None] & (d[None, :] < D),
            other=0.0,
        ).to(q.dtype)  # [BS, BD]; a cache of another dtype (bf16 under fp32) is converted on load
        scores = _dot(q, tl.trans(k), UPCAST) * scale  # [BG, BS]
        p, alpha, m, l = _online_softmax_step(scores, valid[None, :], m, l)
        v = tl.load(
            v_ptr + block_id * stride_vn + s[:, None] * stride_vs + kvh * stride_vh + dv[None, :],
            mask=valid[:, None] & (dv[None, :] < DV),
            other=0.0,
        ).to(q.dtype)  # [BS, BDV]
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, UPCAST)
    out = acc / l[:, None]
    tl.store(
        out_ptr + b * stride_ob + heads[:, None] * stride_oh + dv[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=(g[:, None] < GROUP) & (dv[None, :] < DV),
    )


def _check_common(
    q: torch.Tensor, caches: list[torch.Tensor], block_tables: torch.Tensor, seq_lens: torch.Tensor
) -> None:
    if q.dim() != 3 or q.stride(-1) != 1:
        raise ValueError(f"q: need [B, H, D] with unit last stride, got {tuple(q.shape)} {q.stride()}")
    check_caches(q, caches)
    if block_tables.dim() != 2 or block_tables.shape[0] != q.shape[0] or block_tables.stride(-1) != 1:
        raise ValueError(f"block_tables: need [B={q.shape[0]}, M] contiguous rows, got {tuple(block_tables.shape)}")
    if tuple(seq_lens.shape) != (q.shape[0],) or not seq_lens.is_contiguous():
        raise ValueError(f"seq_lens: need [B={q.shape[0]}], got {tuple(seq_lens.shape)}")
    check_block_size(caches[0])


CACHE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
"""A cache may differ in dtype from the queries (a bf16 cache under an fp32 model): loads convert it."""


def check_caches(q: torch.Tensor, caches: list[torch.Tensor]) -> None:
    for cache in caches:
        if cache.dim() != 4 or cache.stride(-1) != 1 or cache.dtype not in CACHE_DTYPES or cache.device != q.device:
            raise ValueError(
                f"cache: need [N, bs, Hkv, D] in one of {CACHE_DTYPES} on {q.device} with unit last stride, "
                f"got {tuple(cache.shape)} {cache.dtype} on {cache.device} stride {cache.stride()}"
            )


def check_block_size(cache: torch.Tensor) -> None:
    """A cache block is one tl.dot operand dimension; compiled GPU dots need it >= 16 and a power of 2."""
    block_size = cache.shape[1]
    if block_size & (block_size - 1) or (cache.is_cuda and block_size < 16):
        raise ValueError(f"block_size: {block_size} must be a power of 2 (and >= 16 on GPU) for the kernels")


def gqa_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    window: int | None = None,
) -> torch.Tensor:
    """q [B, H, D]; k_cache [N, bs, Hkv, D]; v_cache [N, bs, Hkv, Dv] -> [B, H, Dv] (as the torch reference)."""
    _check_common(q, [k_cache, v_cache], block_tables, seq_lens)
    batch, heads, dim = q.shape
    _, block_size, kv_heads, _ = k_cache.shape
    dim_v = v_cache.shape[-1]
    if k_cache.shape[:3] != v_cache.shape[:3] or k_cache.shape[-1] != dim or heads % kv_heads:
        raise ValueError(f"caches {tuple(k_cache.shape)}/{tuple(v_cache.shape)} do not fit q {tuple(q.shape)}")
    out = q.new_empty(batch, heads, dim_v)
    if batch == 0:
        return out
    _gqa_decode_kernel[(batch, kv_heads)](
        q,
        k_cache,
        v_cache,
        block_tables,
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
        BLOCK_G=_pow2(heads // kv_heads),
        BLOCK_D=_pow2(dim),
        BLOCK_DV=_pow2(dim_v),
        BLOCK_SIZE=block_size,
        UPCAST=upcast_dots(q.dtype),
    )
    return out


@triton.jit
def _mla_decode_kernel(
    q_ptr,
    cache_ptr,
    tables_ptr,
    seq_lens_ptr,
    out_ptr,
    stride_qb,
    stride_qh,
    stride_cn,
    stride_cs,
    stride_tb,
    stride_ob,
    stride_oh,
    scale,
    HEADS: tl.constexpr,
    RANK: tl.constexpr,
    ROPE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    UPCAST: tl.constexpr,
):
    b, hb = tl.program_id(0), tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + b)
    h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    c, r, s = tl.arange(0, BLOCK_C), tl.arange(0, BLOCK_R), tl.arange(0, BLOCK_SIZE)
    h_ok = h < HEADS
    q_row = q_ptr + b * stride_qb + h[:, None] * stride_qh
    q_lat = tl.load(q_row + c[None, :], mask=h_ok[:, None] & (c[None, :] < RANK), other=0.0)  # [BH, BC]
    q_pe = tl.load(q_row + RANK + r[None, :], mask=h_ok[:, None] & (r[None, :] < ROPE), other=0.0)  # [BH, BR]
    m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_C], tl.float32)
    for blk in range(0, tl.cdiv(seq_len, BLOCK_SIZE)):
        block_id = tl.load(tables_ptr + b * stride_tb + blk).to(tl.int64)
        valid = blk * BLOCK_SIZE + s < seq_len
        row = cache_ptr + block_id * stride_cn + s[:, None] * stride_cs
        latent = tl.load(row + c[None, :], mask=valid[:, None] & (c[None, :] < RANK), other=0.0).to(q_lat.dtype)
        k_pe = tl.load(row + RANK + r[None, :], mask=valid[:, None] & (r[None, :] < ROPE), other=0.0).to(q_pe.dtype)
        scores = (_dot(q_lat, tl.trans(latent), UPCAST) + _dot(q_pe, tl.trans(k_pe), UPCAST)) * scale  # [BH, BS]
        p, alpha, m, l = _online_softmax_step(scores, valid[None, :], m, l)
        acc = acc * alpha[:, None] + _dot(p.to(latent.dtype), latent, UPCAST)
    out = acc / l[:, None]
    tl.store(
        out_ptr + b * stride_ob + h[:, None] * stride_oh + c[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=h_ok[:, None] & (c[None, :] < RANK),
    )


def mla_decode_attention(
    q: torch.Tensor, cache: torch.Tensor, rank: int, block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float
) -> torch.Tensor:
    """Absorbed MLA decode. q [B, H, rank + rope] (latent-space query, then rope query);
    cache [N, bs, 1, rank + rope] (latent, then rope key) -> [B, H, rank] latent-space output."""
    _check_common(q, [cache], block_tables, seq_lens)
    batch, heads, width = q.shape
    if cache.shape[2] != 1 or cache.shape[3] != width or not 0 < rank < width:
        raise ValueError(f"cache: need [N, bs, 1, {width}] with 0 < rank < {width}, got {tuple(cache.shape)}")
    out = q.new_empty(batch, heads, rank)
    if batch == 0:
        return out
    block_h = min(16, _pow2(heads))
    _mla_decode_kernel[(batch, triton.cdiv(heads, block_h))](
        q,
        cache,
        block_tables,
        seq_lens,
        out,
        q.stride(0),
        q.stride(1),
        cache.stride(0),
        cache.stride(1),
        block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        scale,
        HEADS=heads,
        RANK=rank,
        ROPE=width - rank,
        BLOCK_H=block_h,
        BLOCK_C=_pow2(rank),
        BLOCK_R=_pow2(width - rank),
        BLOCK_SIZE=cache.shape[1],
        UPCAST=upcast_dots(q.dtype),
    )
    return out
