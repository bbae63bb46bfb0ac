"""ModelRunner: turns a scheduled batch into one forward pass over the paged KV cache."""

from __future__ import annotations

import torch

from ferry.engine.decode_graphs import DecodeGraphs
from ferry.engine.device import device_guard
from ferry.engine.scheduler import ScheduledBatch
from ferry.kernels import fused_decode_enabled, resolve_attention
from ferry.model import AttentionMetadata, LoadedModel


class ModelRunner:
    def __init__(
        self,
        lm: LoadedModel,
        num_blocks: int,
        block_size: int,
        device: str = "cpu",
        kv_dtype: torch.dtype | None = None,
        attention: str | None = None,
        max_num_seqs: int = 64,
        decode_graphs: bool | None = None,
    ) -> None:
        """kv_dtype: the KV cache's dtype; None: the model's. attention: EngineConfig.attention.
        decode_graphs: pure-decode steps through DecodeGraphs (None: on CUDA with the Triton path)."""
        self.lm = lm
        self.device = device
        self.block_size = block_size
        self.attention_backend = resolve_attention(device, attention)
        lm.model.set_attention_backend(self.attention_backend)
        is_cuda = torch.device(device).type == "cuda"
        if decode_graphs is None:
            decode_graphs = is_cuda and self.attention_backend == "triton"
        with device_guard(device):  # one more block when graphs run: their padding rows write there
            self.kv = lm.model.make_kv_cache(num_blocks + decode_graphs, block_size, device, dtype=kv_dtype)
        self.graphs = None
        if decode_graphs:
            max_blocks = -(-lm.config.max_position_embeddings // block_size)
            self.graphs = DecodeGraphs(lm.model, self.kv, num_blocks, max_num_seqs, max_blocks, capture=is_cuda)
        if self.attention_backend == "cpu":
            fused_decode_enabled()  # builds (or loads) the CPU kernel now, not during the first request's step

    def idle(self) -> None:
        """A step with nothing scheduled here: layers that exchange tokens with other ranks (expert
        parallelism) run their collectives with no tokens, so the group's other ranks are not stuck."""
        for module in self.lm.model.modules():
            if hasattr(module, "idle"):
                module.idle()

    def run(self, batch: ScheduledBatch) -> torch.Tensor:
        """-> [B, vocab] float32 logits of each scheduled sequence's last new token."""
        with device_guard(self.device):
            return self.lm.model(*self.prepare(batch), self.kv)

    def prepare(self, batch: ScheduledBatch) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """-> the forward's input_ids [T], positions [T] and attention metadata for batch."""
        input_ids: list[int] = []
        context_lens: list[int] = []
        for seq, num_new in zip(batch.seqs, batch.num_new_tokens):
            start = seq.num_computed_tokens
            input_ids.extend(seq.token_ids[start : start + num_new])
            context_lens.append(start)
        tables = [s.block_ids for s in batch.seqs]
        with device_guard(self.device):
            if self.graphs is not None and self.graphs.runs(batch.num_new_tokens):
                return self.graphs.run(input_ids, context_lens, tables)
            (ids, pos), meta = AttentionMetadata.build_with_inputs(  # one host-to-device copy per step
                batch.num_new_tokens, context_lens, tables, self.block_size, input_ids, self.device
            )
        return ids, pos, meta

    def warmup(self) -> None:
        """Before the engine takes work: one prefill and one decode forward (kernels compiled or built,
        allocator warm) on blocks no sequence holds yet, and every decode graph captured."""
        tokens = min(2 * self.block_size, self.kv.num_blocks * self.block_size)
        blocks = list(range(-(-tokens // self.block_size)))
        with device_guard(self.device):
            for query_len, context_len in ((tokens - 1, 0), (1, tokens - 1)):
                (ids, pos), meta = AttentionMetadata.build_with_inputs(
                    [query_len], [context_len], [blocks], self.block_size, [0] * query_len, self.device
                )
                self.lm.model(ids, pos, meta, self.kv)
            if self.graphs is not None:
                self.graphs.prepare_all()

    @staticmethod
    def block_bytes(lm: LoadedModel, block_size: int, kv_dtype: torch.dtype | None = None) -> int:
        """Bytes one KV block takes, to size the pool from a memory budget."""
        probe = lm.model.make_kv_cache(1, block_size, "cpu", dtype=kv_dtype)
        numel = 1
        for dim in probe.block_shape:
            numel *= dim
        return numel * probe.dtype.itemsize
