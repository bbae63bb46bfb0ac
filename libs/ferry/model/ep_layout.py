"""Where each row sits in an expert-parallel exchange: pure index arithmetic on small integer tensors
(no collectives), shared by the sending and the receiving side of moe_ep.

A rank sends each destination its rows grouped by the destination's local slot; a receiver holds,
per source rank, a block of rows grouped by slot. Its experts want every source's rows of one slot
together (slot-major), and the combine sends each source its rows back in the order they came.
In a padded exchange each block starts with one header row carrying the block's per-slot counts
(bit-copied int32) and is padded to a capacity both sides know, so one all-to-all carries both.
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


def padded_positions(dest_counts: torch.Tensor, block_rows: int) -> torch.Tensor:
    """dest_counts [n]: rows for each destination, sorted by destination; each destination's block
    is block_rows long and starts with one header row. -> [sum] each sorted row's place."""
    total = int(dest_counts.sum())
    dest = torch.repeat_interleave(torch.arange(len(dest_counts), device=dest_counts.device), dest_counts)
    within = torch.arange(total, device=dest_counts.device) - exclusive_cumsum(dest_counts)[dest]
    return dest * block_rows + 1 + within


def header_view(rows: torch.Tensor, num_slots: int) -> torch.Tensor:
    """rows [n, hidden] of any dtype (header rows) -> [n, num_slots] int32 sharing their bytes."""
    as_int = rows.view(torch.int32)
    assert as_int.shape[1] >= num_slots, "a header row holds one int32 count per local slot"
    return as_int[:, :num_slots]
