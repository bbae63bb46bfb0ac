"""AttentionMetadata: where each sequence's new tokens sit in the flat batch and in the paged cache.

One forward carries a batch of sequences of mixed lengths: some prefill a chunk, some decode one
token. Tokens are flattened without padding; per-sequence block tables say where the cache lives.
Built once per step from the scheduler's plain lists: every index tensor is a view of one int64
buffer, filled on the host and copied to the device in one (pinned, non-blocking) transfer; the
host-side lengths stay as tuples, so per-sequence loops and plans never read a device tensor. Frozen:
what a step derives from it (decode gather plans) lives with the KV cache (PagedKVCache.step_cache).
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import accumulate

import torch


@dataclass(frozen=True, slots=True)
class AttentionMetadata:
    query_lens: tuple[int, ...]
    """New tokens of each sequence this step (a prefill chunk, or 1 when decoding)."""
    context_lens: tuple[int, ...]
    """Tokens of each sequence already in the cache before this step."""
    query_starts: tuple[int, ...]
    """[B+1]: sequence i's new tokens are rows query_starts[i]:query_starts[i+1] (host copy)."""
    prefill_rows: tuple[int, ...]
    """Sequences with several new tokens."""
    block_size: int
    """Tokens per cache block."""
    query_start_loc: torch.Tensor
    """[B+1] int64, query_starts on the device."""
    seq_lens: torch.Tensor
    """[B] int64: context + new tokens, i.e. the cache length after this step."""
    slot_mapping: torch.Tensor
    """[T] int64: cache slot (block_id * block_size + offset) each new token is written to."""
    block_tables: torch.Tensor
    """[B, M] int64 block ids, right-padded with 0 (padding is masked out by seq_lens)."""
    logits_indices: torch.Tensor
    """[B] int64: row of each sequence's last new token."""
    decode_token_rows: torch.Tensor
    """[Bd] int64: the token row of each sequence with exactly one new token (attended in one call)."""
    decode_block_tables: torch.Tensor
    """[Bd, M] int64: block_tables of the decoding sequences."""
    decode_seq_lens: torch.Tensor
    """[Bd] int64: seq_lens of the decoding sequences."""

    @property
    def max_query_len(self) -> int:
        return max(self.query_lens, default=0)

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)

    @property
    def num_tokens(self) -> int:
        return self.query_starts[-1]

    @property
    def num_decodes(self) -> int:
        return self.decode_seq_lens.shape[0]

    @property
    def decode_seq_lens_host(self) -> list[int]:
        """seq_lens of the decoding sequences, from the host lengths (no device read)."""
        return [c + 1 for c, q in zip(self.context_lens, self.query_lens) if q == 1]

    @classmethod
    def build(
        cls,
        query_lens: list[int],
        context_lens: list[int],
        block_tables: list[list[int]],
        block_size: int,
        device: torch.device | str = "cpu",
    ) -> AttentionMetadata:
        return cls.build_with_inputs(query_lens, context_lens, block_tables, block_size, [], device)[1]

    @classmethod
    def build_with_inputs(
        cls,
        query_lens: Sequence[int],
        context_lens: Sequence[int],
        block_tables: list[list[int]],
        block_size: int,
        input_ids: list[int],
        device: torch.device | str = "cpu",
    ) -> tuple[tuple[torch.Tensor, torch.Tensor], AttentionMetadata]:
        """-> ((input_ids [T], positions [T]), metadata): a step's model inputs ride in the same single
        transfer as its metadata (input_ids may be [] when only the metadata is wanted)."""
        query_lens, context_lens = tuple(int(q) for q in query_lens), tuple(int(c) for c in context_lens)
        _check(query_lens, context_lens, block_tables, block_size)
        starts = (0, *accumulate(query_lens))
        seq_lens = [c + q for c, q in zip(context_lens, query_lens)]
        width = max((len(t) for t in block_tables), default=0) or 1
        tables = [list(t) + [0] * (width - len(t)) for t in block_tables]
        decode = [i for i, q in enumerate(query_lens) if q == 1]
        parts = {  # name: (values, shape); all int64, one buffer
            "input_ids": (list(input_ids), (len(input_ids),)),
            "positions": (
                [p for c, q in zip(context_lens, query_lens) for p in range(c, c + q)] if input_ids else [],
                None,
            ),
            "query_start_loc": (list(starts), (len(starts),)),
            "seq_lens": (seq_lens, (len(seq_lens),)),
            "slot_mapping": (_slot_mapping(query_lens, context_lens, tables, block_size), (starts[-1],)),
            "block_tables": ([b for t in tables for b in t], (len(tables), width)),
            "logits_indices": ([s - 1 for s in starts[1:]], (len(query_lens),)),
            "decode_token_rows": ([starts[i] for i in decode], (len(decode),)),
            "decode_block_tables": ([b for i in decode for b in tables[i]], (len(decode), width)),
            "decode_seq_lens": ([seq_lens[i] for i in decode], (len(decode),)),
        }
        views = _one_transfer({name: values for name, (values, _) in parts.items()}, torch.device(device))
        tensors = {name: views[name].view(shape or -1) for name, (_, shape) in parts.items()}
        inputs = (tensors.pop("input_ids"), tensors.pop("positions"))
        return inputs, cls(
            query_lens=query_lens,
            context_lens=context_lens,
            query_starts=starts,
            prefill_rows=tuple(i for i, q in enumerate(query_lens) if q != 1),
            block_size=block_size,
            **tensors,
        )


def _one_transfer(parts: dict[str, list[int]], device: torch.device) -> dict[str, torch.Tensor]:
    """Every list in one int64 host buffer (pinned for a GPU), one copy to device -> views by name."""
    flat = array("q")  # int64; torch.tensor(<list>) converted element by element, ~10x slower per step
    for values in parts.values():
        flat.extend(values)
    host = torch.frombuffer(flat, dtype=torch.int64) if flat else torch.empty(0, dtype=torch.int64)
    if device.type == "cuda":
        host = host.pin_memory()
    buffer = host.to(device, non_blocking=True)
    return dict(zip(parts, buffer.split([len(values) for values in parts.values()])))


def _check(query_lens: tuple[int, ...], context_lens: tuple[int, ...], block_tables: list[list[int]], block_size: int):
    if block_size <= 0:
        raise ValueError(f"block_size: must be positive, got {block_size}")
    if not len(query_lens) == len(context_lens) == len(block_tables):
        raise ValueError("query_lens, context_lens, block_tables: need one entry per sequence")
    for i, (q, c, blocks) in enumerate(zip(query_lens, context_lens, block_tables)):
        if q <= 0 or c < 0:
            raise ValueError(f"query_lens[{i}]={q}, context_lens[{i}]={c}: need q > 0 and c >= 0")
        if len(blocks) * block_size < c + q:
            raise ValueError(f"block_tables[{i}]: {len(blocks)} blocks hold fewer than {c + q} tokens")


def _slot_mapping(
    query_lens: tuple[int, ...], context_lens: tuple[int, ...], tables: list[list[int]], block_size: int
) -> list[int]:
    slots: list[int] = []
    for q, c, table in zip(query_lens, context_lens, tables):
        slots.extend(table[p // block_size] * block_size + p % block_size for p in range(c, c + q))
    return slots
