"""Where each row sits in an expert-parallel exchange: pure index arithmetic on small integer tensors
(no collectives), shared by the sending and the receiving side of moe_ep.

In the exact exchange a rank sends each destination its rows grouped by the destination's local
slot; a receiver holds, per source rank, a block of rows grouped by slot. Its experts want every
source's rows of one slot together (slot-major), and the combine sends each source its rows back in
the order they came. In the padded exchange a rank sends every other rank its whole micro-batch, one
row per token, each row tagged with the local slots and weights of its assignments there (-1:
none), so one all-to-all of a size every rank knows beforehand carries the counts, the rows and the
weights.
"""

from __future__ import annotations

import torch


def exclusive_cumsum(counts: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """[..., n] -> where each of n consecutive runs of these lengths starts."""
    return counts.cumsum(dim) - counts


def slot_major_rows(counts: torch.Tensor, block_starts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """counts [n, S]: rows per (source, slot); block_starts [m, n]: m layouts, each giving where each
    source's block starts (its rows slot-sorted inside). -> (rows [m, R]: every row in slot-major
    order, as an index into each layout; ends [S] int32: where each slot's rows end in that order)."""
    starts = block_starts[:, :, None] + exclusive_cumsum(counts)  # [m, n, S] first row of each run
    lengths = counts.t().flatten()  # slot-major: slot 0 of every source, then slot 1, ...
    run_starts = starts.transpose(1, 2).flatten(1)  # [m, S*n]
    total = int(lengths.sum())
    offset_in_run = torch.arange(total, device=counts.device) - torch.repeat_interleave(
        exclusive_cumsum(lengths), lengths, output_size=total
    )
    rows = torch.repeat_interleave(run_starts, lengths, dim=1, output_size=total) + offset_in_run
    return rows, counts.sum(0).cumsum(0).to(torch.int32)


def tagged_width(hidden: int, top_k: int, dtype: torch.dtype) -> int:
    """Columns of a tagged row: the token's hidden state, then its top_k local slots and top_k
    weights as int32 bits (2 * top_k int32 columns in `dtype`'s units)."""
    element = torch.empty(0, dtype=dtype).element_size()
    assert (hidden * element) % 4 == 0, "a tagged row's int32 tags start on a 4-byte boundary"
    return hidden + 2 * top_k * 4 // element


def tag_rows(x: torch.Tensor, slots: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """x [T, H], slots [m, T, k] (each destination's local slot of each assignment, -1 where the
    assignment lives elsewhere), weights [T, k] float32 -> [m*T, W]: block j is x, each row tagged
    with slots[j] and the weights (tagged_width)."""
    num_blocks, tokens, top_k = slots.shape
    hidden = x.shape[1]
    width = tagged_width(hidden, top_k, x.dtype)
    rows = x.new_empty(num_blocks * tokens, width)
    rows.view(num_blocks, tokens, width)[:, :, :hidden] = x
    tags = _tags(rows, hidden).view(num_blocks, tokens, 2 * top_k)
    tags[:, :, :top_k] = slots
    tags[:, :, top_k:] = weights.float().view(torch.int32)
    return rows


def untag_rows(rows: torch.Tensor, hidden: int, top_k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """tag_rows' rows [R, W] -> (hidden states [R, H] (a view), slots [R, k] int64, weights [R, k] float32)."""
    tags = _tags(rows, hidden)
    return rows[:, :hidden], tags[:, :top_k].to(torch.int64), tags[:, top_k:].contiguous().view(torch.float32)


def _tags(rows: torch.Tensor, hidden: int) -> torch.Tensor:
    """rows [R, W] of any dtype -> their int32 tag columns [R, 2k], sharing their bytes."""
    start = hidden * rows.element_size() // 4
    return rows.view(torch.int32)[:, start:]
