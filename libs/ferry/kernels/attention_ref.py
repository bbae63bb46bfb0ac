"""Plain-torch paged attention: the CPU path and the reference the Triton kernels are tested against.

Caches are per layer, logically [N, block_size, H_kv, D] (any strides; PagedKVCache stores them
head-major, and MLA's value cache is a slice of its key cache). Decode attends a whole batch at once:
one index_select per cache gathers every sequence's blocks, then one fused attention call with a
length mask, so there is no Python loop per sequence.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def write_kv(cache: torch.Tensor, slot_mapping: torch.Tensor, values: torch.Tensor) -> None:
    """cache [N, bs, H, D]; slot_mapping [T]; values [T, H, D]."""
    slots = cache.flatten(0, 1)  # [N*bs, H, D]: a view as long as N and bs are mergeable
    assert slots.data_ptr() == cache.data_ptr(), "cache must flatten to a view"
    slots.index_copy_(0, slot_mapping, values.to(cache.dtype))


def gather_seq(cache: torch.Tensor, blocks: torch.Tensor, seq_len: int) -> torch.Tensor:
    """cache [N, bs, H, D]; blocks [M] -> [seq_len, H, D], the sequence's first seq_len cached tokens."""
    block_size = cache.shape[1]
    used = blocks[: (seq_len + block_size - 1) // block_size]
    return cache[used].flatten(0, 1)[:seq_len]


def _gather_heads(cache: torch.Tensor, flat_blocks: torch.Tensor, batch: int,
                  scratch: torch.Tensor | None = None) -> torch.Tensor:
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


def decode_plan(block_tables: torch.Tensor, seq_lens: torch.Tensor, block_size: int,
                window: int | None = None, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """What every layer's decode attention shares in one step: the flat block ids to gather
    [B*M] and the additive mask [B, 1, 1, M*block_size] (-inf on key slots a sequence must not see)."""
    num_cols = (int(seq_lens.max()) + block_size - 1) // block_size
    key_pos = torch.arange(num_cols * block_size, device=seq_lens.device)
    hidden = key_pos[None, :] >= seq_lens[:, None]  # [B, S]
    if window is not None:
        hidden |= key_pos[None, :] <= (seq_lens[:, None] - 1 - window)
    bias = torch.zeros(hidden.shape, dtype=dtype, device=seq_lens.device).masked_fill_(hidden, float("-inf"))
    return block_tables[:, :num_cols].reshape(-1), bias[:, None, None, :]


def _is_prefix_slice(v_cache: torch.Tensor, k_cache: torch.Tensor) -> bool:
    return (v_cache.data_ptr() == k_cache.data_ptr() and v_cache.shape[:3] == k_cache.shape[:3]
            and v_cache.stride() == k_cache.stride())


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                           window: int | None = None,
                           plan: tuple[torch.Tensor, torch.Tensor] | None = None,
                           scratch: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """One new token per sequence, already written to the cache.

    q [B, H, D]; k_cache [N, bs, Hkv, D]; v_cache [N, bs, Hkv, Dv]; block_tables [B, M];
    seq_lens [B]; plan: decode_plan(...) of the same arguments, when the caller reuses it across
    layers; scratch: two flat buffers for the gathered K and V, so no layer allocates them afresh
    -> [B, H, Dv].
    """
    batch, heads, dim = q.shape
    kv_heads = k_cache.shape[2]
    if batch == 0:
        return q.new_empty(0, heads, v_cache.shape[-1])
    flat, bias = plan or decode_plan(block_tables, seq_lens, k_cache.shape[1], window, q.dtype)
    k_scratch, v_scratch = scratch or (None, None)
    k = _gather_heads(k_cache, flat, batch, k_scratch).transpose(0, 1)  # [B, Hkv, S, D]
    if _is_prefix_slice(v_cache, k_cache):  # MLA: values are the latent part of the gathered keys
        v = k[..., : v_cache.shape[-1]]
    else:
        v = _gather_heads(v_cache, flat, batch, v_scratch).transpose(0, 1)  # [B, Hkv, S, Dv]
    # heads sharing a KV head are extra query rows of one fused attention call: no K/V repeat
    qg = q.view(batch, kv_heads, heads // kv_heads, dim)  # [B, Hkv, G, D]
    out = F.scaled_dot_product_attention(qg, k, v, attn_mask=bias, scale=scale)  # [B, Hkv, G, Dv]
    return out.reshape(batch, heads, v.shape[-1])


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, context_len: int,
                      scale: float, window: int | None = None) -> torch.Tensor:
    """One sequence's chunk: q [L, H, D] at positions context_len.., k [S, Hkv, D], v [S, Hkv, Dv]
    covering positions 0..S-1 (S = context_len + L) -> [L, H, Dv]; causal, optional sliding window."""
    length, heads, _ = q.shape
    kv_heads = k.shape[1]
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


def causal_mask(length: int, seq_len: int, context_len: int, window: int | None,
                device: torch.device) -> torch.Tensor:
    """[L, S] bool: query i (position context_len+i) may see key j."""
    q_pos = torch.arange(length, device=device)[:, None] + context_len
    k_pos = torch.arange(seq_len, device=device)[None, :]
    mask = k_pos <= q_pos
    if window is not None:
        mask &= k_pos > q_pos - window
    return mask
