"""AttentionMetadata: where each sequence's new tokens sit in the flat batch and in the paged cache.

One forward carries a batch of sequences of mixed lengths: some prefill a chunk, some decode one
token. Tokens are flattened without padding; per-sequence block tables say where the cache lives.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(slots=True)
class AttentionMetadata:
    query_lens: list[int]
    """New tokens of each sequence this step (a prefill chunk, or 1 when decoding)."""
    context_lens: list[int]
    """Tokens of each sequence already in the cache before this step."""
    block_size: int
    """Tokens per cache block."""
    query_start_loc: torch.Tensor
    """[B+1] int64: sequence i's new tokens are rows query_start_loc[i]:query_start_loc[i+1]."""
    seq_lens: torch.Tensor
    """[B] int64: context + new tokens, i.e. the cache length after this step."""
    slot_mapping: torch.Tensor
    """[T] int64: cache slot (block_id * block_size + offset) each new token is written to."""
    block_tables: torch.Tensor
    """[B, M] int64 block ids, right-padded with 0 (padding is masked out by seq_lens)."""
    logits_indices: torch.Tensor
    """[B] int64: row of each sequence's last new token."""
    decode_rows: torch.Tensor
    """[Bd] int64: sequences with exactly one new token, attended in one batched call."""
    prefill_rows: list[int]
    """Sequences with several new tokens, attended one by one."""
    query_starts: list[int]
    """query_start_loc as a Python list, so per-sequence prefill loops read no tensors."""
    decode_token_rows: torch.Tensor
    """[Bd] int64: the token row of each decoding sequence."""
    decode_block_tables: torch.Tensor
    """[Bd, M] int64: block_tables of the decoding sequences."""
    decode_seq_lens: torch.Tensor
    """[Bd] int64: seq_lens of the decoding sequences."""
    step_cache: dict = field(default_factory=dict)
    """Derived tensors every layer of this step shares (decode gather plans per window), built once."""

    @property
    def max_query_len(self) -> int:
        return max(self.query_lens, default=0)

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)

    @property
    def num_tokens(self) -> int:
        return sum(self.query_lens)

    @classmethod
    def build(
        cls,
        query_lens: list[int],
        context_lens: list[int],
        block_tables: list[list[int]],
        block_size: int,
        device: torch.device | str = "cpu",
    ) -> AttentionMetadata:
        query_lens, context_lens = [int(q) for q in query_lens], [int(c) for c in context_lens]
        _check(query_lens, context_lens, block_tables, block_size)
        starts = [0]
        for q in query_lens:
            starts.append(starts[-1] + q)
        seq_lens = [c + q for c, q in zip(context_lens, query_lens)]
        width = max((len(t) for t in block_tables), default=0) or 1
        table = torch.tensor([list(t) + [0] * (width - len(t)) for t in block_tables], dtype=torch.int64)
        table = table.view(len(block_tables), width)
        slots = _slot_mapping(query_lens, context_lens, table, block_size)
        decode = [i for i, q in enumerate(query_lens) if q == 1]

        def as_tensor(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int64, device=device)

        table = table.to(device)
        return cls(
            query_lens=query_lens,
            context_lens=context_lens,
            block_size=block_size,
            query_start_loc=as_tensor(starts),
            seq_lens=as_tensor(seq_lens),
            slot_mapping=slots.to(device),
            block_tables=table,
            logits_indices=as_tensor([s - 1 for s in starts[1:]]),
            decode_rows=as_tensor(decode),
            prefill_rows=[i for i, q in enumerate(query_lens) if q != 1],
            query_starts=starts,
            decode_token_rows=as_tensor([starts[i] for i in decode]),
            decode_block_tables=table[as_tensor(decode)],
            decode_seq_lens=as_tensor([seq_lens[i] for i in decode]),
        )


def _check(query_lens: list[int], context_lens: list[int], block_tables: list[list[int]], block_size: int) -> None:
    if block_size <= 0:
        raise ValueError(f"block_size: must be positive, got {block_size}")
    if not len(query_lens) == len(context_lens) == len(block_tables):
        raise ValueError("query_lens, context_lens, block_tables: need one entry per sequence")
    for i, (q, c, blocks) in enumerate(zip(query_lens, context_lens, block_tables)):
        if q <= 0 or c < 0:
            raise ValueError(f"query_lens[{i}]={q}, context_lens[{i}]={c}: need q > 0 and c >= 0")
        if len(blocks) * block_size < c + q:
            raise ValueError(f"block_tables[{i}]: {len(blocks)} blocks hold fewer than {c + q} tokens")


def _slot_mapping(query_lens: list[int], context_lens: list[int], table: torch.Tensor, block_size: int) -> torch.Tensor:
    rows = torch.repeat_interleave(torch.arange(len(query_lens)), torch.tensor(query_lens))  # [T]
    starts = torch.tensor(context_lens, dtype=torch.int64)
    first = torch.cumsum(torch.tensor([0] + query_lens[:-1]), 0)
    positions = starts[rows] + torch.arange(rows.numel()) - first[rows]  # [T]
    blocks = table[rows, positions // block_size]
    return blocks * block_size + positions % block_size
