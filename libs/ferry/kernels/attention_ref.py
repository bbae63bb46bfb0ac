"""Plain-torch paged attention: the CPU path and the reference the Triton kernels are tested against.

Caches are per layer, logically [N, block_size, H_kv, D] (any strides; PagedKVCache stores them
head-major, and MLA's value cache is a slice of its key cache). Decode attends a whole batch at once:
one index_select per cache gathers every sequence's blocks, then two batched matmuls with a length
mask, so there is no Python loop per sequence.
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


def _gather_heads(cache: torch.Tensor, flat_blocks: torch.Tensor, batch: int) -> torch.Tensor:
    """cache [N, bs, Hkv, D], flat_blocks [B*M] -> [Hkv, B, M*bs, D], contiguous."""
    heads = cache.permute(2, 0, 1, 3)  # [Hkv, N, bs, D]
    return heads.index_select(1, flat_blocks).view(heads.shape[0], batch, -1, heads.shape[-1])


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                           window: int | None = None) -> torch.Tensor:
    """One new token per sequence, already written to the cache.

    q [B, H, D]; k_cache [N, bs, Hkv, D]; v_cache [N, bs, Hkv, Dv]; block_tables [B, M];
    seq_lens [B] -> [B, H, Dv].
    """
    batch, heads, dim = q.shape
    kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
    if batch == 0:
        return q.new_empty(0, heads, v_cache.shape[-1])
    num_cols = (int(seq_lens.max()) + block_size - 1) // block_size
    flat = block_tables[:, :num_cols].reshape(-1)
    k = _gather_heads(k_cache, flat, batch)  # [Hkv, B, S, D]
    v = _gather_heads(v_cache, flat, batch)  # [Hkv, B, S, Dv]
    key_pos = torch.arange(k.shape[2], device=q.device)
    hidden = key_pos[None, :] >= seq_lens[:, None]  # [B, S]
    if window is not None:
        hidden |= key_pos[None, :] <= (seq_lens[:, None] - 1 - window)
    # heads sharing a KV head are extra query rows of one matmul, so GQA never repeats K/V
    qh = q.view(batch, kv_heads, heads // kv_heads, dim).transpose(0, 1)  # [Hkv, B, G, D]
    scores = torch.matmul(qh, k.transpose(-1, -2)).mul_(scale)  # [Hkv, B, G, S]
    scores.masked_fill_(hidden[None, :, None, :], float("-inf"))
    out = torch.matmul(scores.softmax(-1), v)  # [Hkv, B, G, Dv]
    return out.transpose(0, 1).reshape(batch, heads, v.shape[-1])


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, context_len: int,
                      scale: float, window: int | None = None) -> torch.Tensor:
    """One sequence's chunk: q [L, H, D] at positions context_len.., k [S, Hkv, D], v [S, Hkv, Dv]
    covering positions 0..S-1 (S = context_len + L) -> [L, H, Dv]; causal, optional sliding window."""
    length, heads, _ = q.shape
    qh, kh, vh = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)  # [H, L|S, D]
    gqa = k.shape[1] != heads  # SDPA shares each KV head among its query heads, no repeat copy
    if context_len == 0 and window is None:
        out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale, enable_gqa=gqa)
    else:
        mask = causal_mask(length, k.shape[0], context_len, window, q.device)
        out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=scale, enable_gqa=gqa)
    return out.transpose(0, 1)


def causal_mask(length: int, seq_len: int, context_len: int, window: int | None,
                device: torch.device) -> torch.Tensor:
    """[L, S] bool: query i (position context_len+i) may see key j."""
    q_pos = torch.arange(length, device=device)[:, None] + context_len
    k_pos = torch.arange(seq_len, device=device)[None, :]
    mask = k_pos <= q_pos
    if window is not None:
        mask &= k_pos > q_pos - window
    return mask
