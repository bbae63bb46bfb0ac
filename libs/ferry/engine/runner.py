"""ModelRunner: turns a scheduled batch into one forward pass over the paged KV cache."""

from __future__ import annotations

import torch

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
    ) -> None:
        """kv_dtype: the KV cache's dtype; None: the model's. attention: EngineConfig.attention."""
        self.lm = lm
        self.device = device
        self.block_size = block_size
        self.attention_backend = resolve_attention(device, attention)
        lm.model.set_attention_backend(self.attention_backend)
        with device_guard(device):
            self.kv = lm.model.make_kv_cache(num_blocks, block_size, device, dtype=kv_dtype)
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
            (ids, pos), meta = AttentionMetadata.build_with_inputs(  # one host-to-device copy per step
                batch.num_new_tokens, context_lens, tables, self.block_size, input_ids, self.device
            )
        return ids, pos, meta

    @staticmethod
    def block_bytes(lm: LoadedModel, block_size: int, kv_dtype: torch.dtype | None = None) -> int:
        """Bytes one KV block takes, to size the pool from a memory budget."""
        probe = lm.model.make_kv_cache(1, block_size, "cpu", dtype=kv_dtype)
        numel = 1
        for dim in probe.block_shape:
            numel *= dim
        return numel * probe.dtype.itemsize
