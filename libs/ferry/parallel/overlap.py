"""Dual micro-batch overlap: a step's batch runs as two micro-batches whose all-to-alls hide behind
each other's compute.

Each micro-batch's forward is a generator that yields right after launching an all-to-all (async
work handle); the driver resumes the other micro-batch meanwhile, so while A's tokens travel to
their experts B computes its attention, and while B's travel A computes its experts. Every rank
runs the same two generators in the same alternation, each yielding once per all-to-all launch
(two or three per MoE layer: every rank picks the same exchange, ExpertParallelMoE._pads)
whatever its token count, so the group's collectives are issued in the same order everywhere.
Sequences split at a sequence boundary, tokens as even as that allows; an empty half still runs.
"""

from __future__ import annotations

import time
from collections.abc import Generator
from typing import Any

import torch
import torch.distributed as dist

from ferry.engine.device import device_guard
from ferry.engine.runner import ModelRunner
from ferry.engine.scheduler import ScheduledBatch
from ferry.model.attention_meta import AttentionMetadata
from ferry.model.causal_lm import CausalLM
from ferry.model.kv_cache import PagedKVCache
from ferry.model.moe_ep import ExpertParallelMoE, run_to_end
from ferry.parallel.shard import expert_parallel_layers

MODES = ("single", "sequential", "overlap")
"""single: one batch; sequential: two micro-batches one after the other (the baseline overlap is
measured against); overlap: two micro-batches interleaved."""


def split_batch(batch: ScheduledBatch) -> tuple[ScheduledBatch, ScheduledBatch]:
    """Two halves at the sequence boundary that evens their token counts best (order kept)."""
    total, running, cut = sum(batch.num_new_tokens), 0, 0
    best = total
    for i, num_new in enumerate(batch.num_new_tokens, 1):
        running += num_new
        if abs(total - 2 * running) < best:
            best, cut = abs(total - 2 * running), i
    return (
        ScheduledBatch(batch.seqs[:cut], batch.num_new_tokens[:cut]),
        ScheduledBatch(batch.seqs[cut:], batch.num_new_tokens[cut:]),
    )


def forward_steps(
    model: CausalLM,
    ids: torch.Tensor,
    pos: torch.Tensor,
    meta: AttentionMetadata | None,
    kv: PagedKVCache,
    peer_tokens: list[int] | None = None,
) -> Generator[None, None, torch.Tensor | None]:
    """CausalLM.forward as a generator yielding at each all-to-all launch; None for no tokens.
    peer_tokens: this micro-batch's token count on every rank (ExpertParallelMoE.steps)."""
    x = model.model.embed_tokens(ids)  # [T, hidden]
    has_tokens = len(ids) > 0
    cos, sin = model.rotary.cos_sin(pos, x.dtype) if has_tokens else (None, None)
    layer: Any  # a decoder layer (nn.ModuleList yields Module)
    for layer in model.model.layers:
        if has_tokens:
            x = x + layer.self_attn(layer.input_layernorm(x), cos, sin, meta, kv)
        h = layer.post_attention_layernorm(x) if has_tokens else x
        if isinstance(layer.mlp, ExpertParallelMoE):
            x = x + (yield from layer.mlp.steps(h, peer_tokens))
        elif has_tokens:
            x = x + layer.mlp(h)
    if not has_tokens:
        return None
    assert meta is not None, "a forward with tokens has metadata"
    return model.lm_head(model.model.norm(x[meta.logits_indices])).float()


def interleave(generators: list[Generator[Any, None, Any]]) -> list:
    """Runs generators round-robin, one segment each in turn, until all are done; -> their results."""
    results: list = [None] * len(generators)
    active = list(range(len(generators)))
    while active:
        for i in list(active):
            try:
                next(generators[i])
            except StopIteration as stop:
                results[i] = stop.value
                active.remove(i)
    return results


class OverlapRunner(ModelRunner):
    """A ModelRunner for an expert-parallel rank that runs each step in `mode` (see MODES)."""

    mode: str = "overlap"
    comm_wait_s: float = 0.0
    """Seconds blocked in the per-step all-gather of token counts (the layers count their own)."""

    @classmethod
    def replacing(cls, runner: ModelRunner, mode: str = "overlap") -> OverlapRunner:
        """Takes over runner's model and KV pool (same blocks, nothing copied)."""
        if mode not in MODES:
            raise ValueError(f"mode: {mode!r}, expected one of {MODES}")
        new = cls.__new__(cls)
        new.__dict__.update(runner.__dict__)
        new.mode = mode
        return new

    def run(self, batch: ScheduledBatch) -> torch.Tensor:
        parts = (batch,) if self.mode == "single" else split_batch(batch)
        with torch.inference_mode(), device_guard(self.device):
            peer_tokens = self._peer_tokens([sum(part.num_new_tokens) for part in parts])
            generators = [
                forward_steps(self.lm.model, *self._inputs(part), self.kv, tokens)
                for part, tokens in zip(parts, peer_tokens)
            ]
            if self.mode == "overlap":
                logits = interleave(generators)
            else:
                logits = [run_to_end(g) for g in generators]
        found = [part for part in logits if part is not None]
        return torch.cat(found) if found else torch.empty(0, self.lm.config.vocab_size)

    def idle(self) -> None:
        self.run(ScheduledBatch())  # empty micro-batches: the same collectives as a busy rank

    def _peer_tokens(self, tokens: list[int]) -> list[list[int]]:
        """[micro-batch][rank] tokens, from one all-gather: every rank learns how many rows each
        other rank's dispatches hold before any is posted (ExpertParallelMoE._pads)."""
        layers = expert_parallel_layers(self.lm)
        group = layers[0][1].group if layers else None
        mine = torch.tensor(tokens, dtype=torch.int64, device=self.device)
        every = mine.new_empty(dist.get_world_size(group) * len(tokens))
        start = time.perf_counter()
        _all_gather_single(every, mine, group=group)
        gathered = every.view(-1, len(tokens)).t().tolist()
        self.comm_wait_s += time.perf_counter() - start
        return gathered

    def _inputs(self, half: ScheduledBatch) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata | None]:
        if half.is_empty:
            empty = torch.empty(0, dtype=torch.int64, device=self.device)
            return empty, empty, None
        return self.prepare(half)


# torch 2.13 renamed all_gather_into_tensor to all_gather_single (the old name warns); GPU users' CUDA builds
# may be older (pyproject allows torch>=2.4)
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
