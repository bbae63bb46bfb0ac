"""DecodeGraphs: pure-decode steps replayed from CUDA graphs captured at bucketed batch sizes.

A decode step of a small model on a GPU is dozens of kernel launches of microseconds each: the CPU
issuing them, not the GPU, sets the step time. A CUDA graph replays the whole forward with one launch.
Graphs are captured once per batch-size bucket (1, 2, 4, 8, ... up to max_num_seqs) on static input
buffers; a step of B sequences is padded to its bucket: padding rows decode token 0 at position 0
into a block reserved for them (pad_block, outside the block manager's pool), with a one-token
context, so they touch no real sequence's cache, and their logits are dropped. Only the Triton path on
CUDA is captured (no host reads in its forward: tests/unit/test_engine_triton.py); capture=False runs
the same padded buffers eagerly, which is how the CPU tests check the padding.
"""

from __future__ import annotations

from typing import Any

import torch

from ferry.model import AttentionMetadata


def decode_buckets(max_num_seqs: int) -> list[int]:
    """Powers of two below max_num_seqs, then max_num_seqs itself."""
    buckets, size = [], 1
    while size < max_num_seqs:
        buckets.append(size)
        size *= 2
    return [*buckets, max_num_seqs]


def bucket_for(num_seqs: int, buckets: list[int]) -> int | None:
    return next((b for b in buckets if b >= num_seqs), None)


class DecodeGraphs:
    def __init__(self, model, kv, pad_block: int, max_num_seqs: int, max_blocks_per_seq: int, capture: bool):
        self.model, self.kv, self.pad_block, self.capture = model, kv, pad_block, capture
        self.block_size = kv.block_size
        self.buckets = decode_buckets(max_num_seqs)
        self.width = max_blocks_per_seq
        device = kv.data.device
        most = self.buckets[-1]
        # [ids | positions | slots | seq_lens | tables]: one host buffer, one copy per step
        self._host = torch.zeros(4 * most + most * self.width, dtype=torch.int64)
        if device.type == "cuda":
            self._host = self._host.pin_memory()
        self._device = torch.zeros_like(self._host, device=device)
        # Every tensor a captured graph reads must outlive the capture: a temporary made for it would be
        # freed afterwards and its memory reused, and the replay would read whatever lands there.
        self._arange = torch.arange(most + 1, device=device)
        self._graphs: dict[int, tuple[Any, torch.Tensor]] = {}  # bucket: (CUDAGraph or None, its logits)
        self._context_lens: tuple[int, ...] = ()
        self._pool: Any = None  # the graphs share one memory pool

    def runs(self, num_new_tokens: list[int]) -> bool:
        """True for a pure-decode step that fits a bucket."""
        return bucket_for(len(num_new_tokens), self.buckets) is not None and all(n == 1 for n in num_new_tokens)

    def run(self, token_ids: list[int], context_lens: list[int], block_tables: list[list[int]]) -> torch.Tensor:
        """One decode step of B sequences (token_ids [B], each sequence's cached length and blocks)
        -> [B, vocab] logits."""
        num_seqs = len(token_ids)
        bucket = bucket_for(num_seqs, self.buckets)
        assert bucket is not None, "run() only steps that runs() accepts"
        self._fill(token_ids, context_lens, block_tables, bucket)
        if bucket not in self._graphs:  # not warmed up: prepared now, on this step's inputs
            self._graphs[bucket] = self._prepare(bucket)
        graph, logits = self._graphs[bucket]
        if graph is None:
            logits = self._forward(bucket)
        else:
            graph.replay()
            logits = logits.clone()  # the graph's output buffer is overwritten by the next replay
        return logits[:num_seqs]

    def prepare_all(self) -> None:
        """Warm-up: every bucket captured (or, eagerly, run once) before the engine takes work."""
        for bucket in self.buckets:
            if bucket not in self._graphs:
                self._fill([0] * bucket, [0] * bucket, [[self.pad_block]] * bucket, bucket)
                self._graphs[bucket] = self._prepare(bucket)

    @property
    def prepared_buckets(self) -> list[int]:
        return sorted(self._graphs)

    def _fill(self, token_ids: list[int], context_lens: list[int], block_tables: list[list[int]], bucket: int):
        most, width, bs = self.buckets[-1], self.width, self.block_size
        pad = bucket - len(token_ids)
        ids = list(token_ids) + [0] * pad
        positions = list(context_lens) + [0] * pad
        tables = [list(t) + [self.pad_block] * (width - len(t)) for t in block_tables]
        tables += [[self.pad_block] * width] * pad
        slots = [tables[i][p // bs] * bs + p % bs for i, p in enumerate(positions)]
        seq_lens = [p + 1 for p in positions]
        host = self._host
        for part, values in enumerate((ids, positions, slots, seq_lens)):
            host[part * most : part * most + bucket] = torch.tensor(values, dtype=torch.int64)
        host[4 * most : 4 * most + bucket * width] = torch.tensor([b for t in tables for b in t], dtype=torch.int64)
        self._device.copy_(host, non_blocking=True)
        self._context_lens = tuple(positions)

    def _inputs(self, bucket: int) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        most, buf = self.buckets[-1], self._device
        ids, positions, slots, seq_lens = (buf[p * most : p * most + bucket] for p in range(4))
        tables = buf[4 * most : 4 * most + bucket * self.width].view(bucket, self.width)
        rows = self._arange[:bucket]
        meta = AttentionMetadata(
            query_lens=(1,) * bucket,
            context_lens=self._context_lens,  # baked into a captured graph, where nothing reads them
            query_starts=tuple(range(bucket + 1)),
            prefill_rows=(),
            block_size=self.block_size,
            query_start_loc=self._arange[: bucket + 1],
            seq_lens=seq_lens,
            slot_mapping=slots,
            block_tables=tables,
            logits_indices=rows,
            decode_token_rows=rows,
            decode_block_tables=tables,
            decode_seq_lens=seq_lens,
        )
        return ids, positions, meta

    def _forward(self, bucket: int) -> torch.Tensor:
        ids, positions, meta = self._inputs(bucket)
        return self.model(ids, positions, meta, self.kv)

    def _prepare(self, bucket: int) -> tuple[object, torch.Tensor]:
        if not self.capture:
            return None, self._forward(bucket)
        ids, positions, meta = self._inputs(bucket)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # compile and allocate outside the capture
            for _ in range(2):
                self.model(ids, positions, meta, self.kv)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            logits = self.model(ids, positions, meta, self.kv)
        self._pool = graph.pool()
        return graph, logits
