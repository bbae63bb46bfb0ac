"""Plain-torch paged attention: the CPU path and the reference the Triton kernels are tested against.

Caches are per layer, logically [N, block_size, H_kv, D] (any strides; PagedKVCache stores them
head-major, and MLA's value cache is a slice of its key cache). Decode attends a whole batch at once:
sequences are grouped into a few length buckets (decode_plan), and per bucket one index_select per
cache gathers every sequence's blocks, then batched matmuls with a length mask: no Python loop per
sequence, and short sequences are not padded to the batch's longest.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ferry.dtypes import raw_view


def write_kv(cache: torch.Tensor, slot_mapping: torch.Tensor, values: torch.Tensor) -> None:
    """cache [N, bs, H, D]; slot_mapping [T]; values [T, H, D]."""
    slots = cache.flatten(0, 1)  # [N*bs, H, D]: a view as long as N and bs are mergeable
    assert slots.data_ptr() == cache.data_ptr(), "cache must flatten to a view"
    raw_view(slots).index_copy_(0, slot_mapping, raw_view(values.to(cache.dtype)))  # raw: fp8 has no index_copy_


def gather_seq(cache: torch.Tensor, blocks: torch.Tensor, seq_len: int) -> torch.Tensor:
    """cache [N, bs, H, D]; blocks [M] -> [seq_len, H, D], the sequence's first seq_len cached tokens."""
    block_size = cache.shape[1]
    used = blocks[: (seq_len + block_size - 1) // block_size]
    return cache[used].flatten(0, 1)[:seq_len]


def _gather_heads(
    cache: torch.Tensor, flat_blocks: torch.Tensor, batch: int, scratch: torch.Tensor | None = None
) -> torch.Tensor:
    """cache [N, bs, Hkv, D], flat_blocks [B*M] -> [Hkv, B, M*bs, D], contiguous; written into
    scratch (a flat buffer reused step after step) when given and big enough."""
    heads = cache.permute(2, 0, 1, 3)  # [Hkv, N, bs, D]
    shape = (heads.shape[0], flat_blocks.numel(), heads.shape[2], heads.shape[3])
    numel = shape[0] * shape[1] * shape[2] * shape[3]
    if scratch is not None and scratch.numel() >= numel and scratch.dtype == cache.dtype:
        gathered = torch.index_select(heads, 1, flat_blocks, out=scratch[:numel].view(shape))
    else:
        gathered = heads.index_select(1, flat_blocks)
    return gathered.view(heads.shape[0], batch, -1, heads.shape[-1])


BUCKET_OVERHEAD_SLOTS = 256
"""Cost of one more decode bucket (its gather, matmuls and scatter: ~10 small ops per layer) in
padded key slots, which cost ~0.4 us each per layer on the CPU path; bucketing pays when it saves more."""


@dataclass(slots=True)
class DecodeBucket:
    rows: torch.Tensor | None
    """[b] int64 rows of the batch in this bucket, or None: all rows, in order."""
    flat_blocks: torch.Tensor
    """[b*M] block ids to gather, M = the bucket's longest sequence in blocks."""
    bias: torch.Tensor
    """[b, M*block_size] additive mask: -inf on key slots a sequence must not see."""


def decode_plan(
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    block_size: int,
    window: int | None = None,
    dtype: torch.dtype = torch.float32,
    host_seq_lens: list[int] | None = None,
) -> list[DecodeBucket]:
    """What every layer's decode attention shares in one step. Sequences are grouped by length so
    each group is padded only to its own longest member (padding a batch to its single longest
    sequence made short sequences pay for long ones); groups are chosen to minimise padded slots
    plus BUCKET_OVERHEAD_SLOTS per group. host_seq_lens: seq_lens as a list, so that grouping reads
    nothing from the device (AttentionMetadata.decode_seq_lens_host); without it seq_lens is read."""
    host_seq_lens = seq_lens.tolist() if host_seq_lens is None else host_seq_lens
    cols = [(n + block_size - 1) // block_size for n in host_seq_lens]
    groups = _length_groups(cols, block_size)
    if len(groups) == 1:
        return [_bucket(None, block_tables, seq_lens, max(cols), block_size, window, dtype)]
    order = sorted(range(len(cols)), key=cols.__getitem__)
    buckets, start = [], 0
    for end, width in groups:
        rows = torch.tensor(order[start:end], dtype=torch.int64, device=seq_lens.device)
        buckets.append(_bucket(rows, block_tables[rows], seq_lens[rows], width, block_size, window, dtype))
        start = end
    return buckets


def _length_groups(cols: list[int], block_size: int) -> list[tuple[int, int]]:
    """-> [(end, width)] over the rows sorted by length: groups of sorted rows [prev_end, end) padded
    to width blocks; optimal by dynamic programming over the distinct lengths."""
    widths = sorted(set(cols))
    counts = [cols.count(w) for w in widths]
    ends = [sum(counts[: i + 1]) for i in range(len(widths))]
    best = [0.0] + [float("inf")] * len(widths)  # best[i]: cost of the first i distinct lengths
    cut = [0] * (len(widths) + 1)
    for i in range(1, len(widths) + 1):
        for j in range(i):
            rows = ends[i - 1] - (ends[j - 1] if j else 0)
            cost = best[j] + BUCKET_OVERHEAD_SLOTS + rows * widths[i - 1] * block_size
            if cost < best[i]:
                best[i], cut[i] = cost, j
    groups, i = [], len(widths)
    while i:
        groups.append((ends[i - 1], widths[i - 1]))
        i = cut[i]
    return groups[::-1]


def _bucket(
    rows: torch.Tensor | None,
    tables: torch.Tensor,
    seq_lens: torch.Tensor,
    num_cols: int,
    block_size: int,
    window: int | None,
    dtype: torch.dtype,
) -> DecodeBucket:
    key_pos = torch.arange(num_cols * block_size, device=seq_lens.device)
    hidden = key_pos[None, :] >= seq_lens[:, None]  # [b, S]
    if window is not None:
        hidden |= key_pos[None, :] <= (seq_lens[:, None] - 1 - window)
    bias = torch.zeros(hidden.shape, dtype=dtype, device=seq_lens.device).masked_fill_(hidden, float("-inf"))
    return DecodeBucket(rows, tables[:, :num_cols].reshape(-1), bias)


def _is_prefix_slice(v_cache: torch.Tensor, k_cache: torch.Tensor) -> bool:
    return (
        v_cache.data_ptr() == k_cache.data_ptr()
        and v_cache.shape[:3] == k_cache.shape[:3]
        and v_cache.stride() == k_cache.stride()
    )


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    window: int | None = None,
    plan: list[DecodeBucket] | None = None,
    scratch: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """One new token per sequence, already written to the cache.

    q [B, H, D]; k_cache [N, bs, Hkv, D]; v_cache [N, bs, Hkv, Dv]; block_tables [B, M];
    seq_lens [B]; plan: decode_plan(...) of the same arguments, when the caller reuses it across
    layers; scratch: two flat buffers for the gathered K and V, so no layer allocates them afresh
    -> [B, H, Dv].
    """
    batch, heads, _ = q.shape
    if batch == 0:
        return q.new_empty(0, heads, v_cache.shape[-1])
    plan = plan or decode_plan(block_tables, seq_lens, k_cache.shape[1], window, q.dtype)
    if len(plan) == 1 and plan[0].rows is None:
        return _attend_bucket(q, k_cache, v_cache, plan[0], scale, scratch)
    out = q.new_empty(batch, heads, v_cache.shape[-1])
    for bucket in plan:
        out[bucket.rows] = _attend_bucket(q[bucket.rows], k_cache, v_cache, bucket, scale, scratch)
    return out


def _attend_bucket(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    bucket: DecodeBucket,
    scale: float,
    scratch: tuple[torch.Tensor, torch.Tensor] | None,
) -> torch.Tensor:
    """q [b, H, D] of one bucket's sequences -> [b, H, Dv]."""
    batch, heads, dim = q.shape
    kv_heads = k_cache.shape[2]
    k_scratch, v_scratch = scratch or (None, None)
    # keep the gather's head-major order [Hkv, b, S, D]: flattening it to [Hkv*b, S, D] is a view,
    # so the batched matmuls below read the gathered cache with no further copy
    # a cache in another dtype than q (a bf16 cache under an fp32 model) is widened after the gather
    k = _gather_heads(k_cache, bucket.flat_blocks, batch, k_scratch).flatten(0, 1).to(q.dtype)  # [Hkv*b, S, D]
    if _is_prefix_slice(v_cache, k_cache):  # MLA: values are the latent part of the gathered keys
        v = k[..., : v_cache.shape[-1]]
    else:
        v = _gather_heads(v_cache, bucket.flat_blocks, batch, v_scratch).flatten(0, 1).to(q.dtype)  # [Hkv*b, S, Dv]
    # heads sharing a KV head are extra query rows of one matmul: no K/V repeat. Plain baddbmm/bmm
    # beat CPU SDPA here (~2x at G=2 query rows): its flash tiling does not pay off for so few rows
    group, width = heads // kv_heads, bucket.bias.shape[-1]
    qg = q.view(batch, kv_heads, group, dim).transpose(0, 1).reshape(kv_heads * batch, group, dim)
    mask = bucket.bias.view(1, batch, 1, width).expand(kv_heads, batch, 1, width).reshape(-1, 1, width)
    scores = torch.baddbmm(mask, qg, k.transpose(1, 2), alpha=scale)  # [Hkv*b, G, S]
    out = torch.bmm(torch.softmax(scores, dim=-1), v)  # [Hkv*b, G, Dv]
    return out.view(kv_heads, batch, group, -1).permute(1, 0, 2, 3).reshape(batch, heads, v.shape[-1])


def prefill_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, context_len: int, scale: float, window: int | None = None
) -> torch.Tensor:
    """One sequence's chunk: q [L, H, D] at positions context_len.., k [S, Hkv, D], v [S, Hkv, Dv]
    covering positions 0..S-1 (S = context_len + L) -> [L, H, Dv]; causal, optional sliding window."""
    length, heads, _ = q.shape
    kv_heads = k.shape[1]
    k, v = k.to(q.dtype), v.to(q.dtype)  # K/V gathered from a cache of another dtype (bf16 under fp32)
    # 4-D [1, H, L|S, D]: torch's fused CPU attention kernel takes only 4-D inputs (3-D falls back to math)
    qh, kh, vh = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))
    if kv_heads != heads:  # repeat K/V heads: SDPA's enable_gqa falls back to the slow math path on CPU
        kh = kh.repeat_interleave(heads // kv_heads, dim=1)
        vh = vh.repeat_interleave(heads // kv_heads, dim=1)
    if context_len == 0 and window is None:
        out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale)
    else:
        mask = causal_mask(length, k.shape[0], context_len, window, q.device)
        out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=scale)
    return out[0].transpose(0, 1)


CHUNK_MATMUL_MAX_TOKENS = 192
"""Longest prefill chunk on a cached context that chunk_attention takes; longer ones gather the context
and run SDPA. Measured (1 thread, 8 heads / 4 KV heads, D 64, 580-token context): 45 tokens 2.0 ms vs
3.2 ms for gather + SDPA and 4.9 ms for the fused decode kernel; at ~200 tokens SDPA catches up."""


def chunk_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    blocks: torch.Tensor,
    context_len: int,
    scale: float,
    window: int | None = None,
) -> torch.Tensor:
    """One sequence's prefill chunk against its cache, q [L, H, D] at positions context_len.. (the chunk's
    own K/V already written); caches [N, bs, Hkv, D|Dv], blocks [M] -> [L, H, Dv]. The context is gathered
    head-major once and the heads sharing a KV head become extra query rows of one matmul: two batched
    matmuls per layer, where the fused decode kernel re-reads the whole context once per query row."""
    length, heads, dim = q.shape
    kv_heads, total = k_cache.shape[2], context_len + length
    k = _gather_context(k_cache, blocks, total).to(q.dtype)  # [Hkv, S, D]
    v = _gather_context(v_cache, blocks, total).to(q.dtype)  # [Hkv, S, Dv]
    group = heads // kv_heads
    qg = q.view(length, kv_heads, group, dim).permute(1, 2, 0, 3).reshape(kv_heads, group * length, dim)
    hidden = ~causal_mask(length, total, context_len, window, q.device)  # [L, S]
    bias = torch.zeros(hidden.shape, dtype=q.dtype, device=q.device).masked_fill_(hidden, float("-inf"))
    scores = torch.baddbmm(bias.repeat(group, 1), qg, k.transpose(1, 2), alpha=scale)  # [Hkv, G*L, S]
    out = torch.bmm(torch.softmax(scores, dim=-1), v)  # [Hkv, G*L, Dv]
    return out.view(kv_heads, group, length, -1).permute(2, 0, 1, 3).reshape(length, heads, v.shape[-1])


def _gather_context(cache: torch.Tensor, blocks: torch.Tensor, seq_len: int) -> torch.Tensor:
    """cache [N, bs, Hkv, D]; blocks [M] -> [Hkv, seq_len, D], the sequence's first seq_len tokens."""
    used = blocks[: (seq_len + cache.shape[1] - 1) // cache.shape[1]]
    return cache.permute(2, 0, 1, 3).index_select(1, used).flatten(1, 2)[:, :seq_len]


def causal_mask(length: int, seq_len: int, context_len: int, window: int | None, device: torch.device) -> torch.Tensor:
    """[L, S] bool: query i (position context_len+i) may see key j."""
    q_pos = torch.arange(length, device=device)[:, None] + context_len
    k_pos = torch.arange(seq_len, device=device)[None, :]
    mask = k_pos <= q_pos
    if window is not None:
        mask &= k_pos > q_pos - window
    return mask
