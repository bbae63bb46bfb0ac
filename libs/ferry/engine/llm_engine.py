"""LLMEngine: add requests, step, get outputs. One step = schedule -> run the model -> postprocess.

Roles: 'both' runs requests start to finish; 'prefill' stops a request after its first token and
pins its KV until take_prefilled(); 'decode' (or any role) admits sequences whose KV arrives from
outside with add_prefilled(). No NATS, no Redis: the workers wrap this.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from pathlib import Path

import torch

from ferry.engine.block_manager import BlockManager
from ferry.engine.config import EngineConfig, resolve_prefill_order, resolve_prefill_split_tokens
from ferry.engine.host_cache import HostBlockCache
from ferry.engine.host_tier import HostTier
from ferry.engine.kv_copy import KvCopier
from ferry.engine.kv_handoff import KvHandoff
from ferry.engine.kv_tiers import KvTiers
from ferry.engine.outputs import EngineStats, RequestOutput
from ferry.engine.request_state import RequestState
from ferry.engine.runner import ModelRunner
from ferry.engine.sampler import sample
from ferry.engine.scheduler import ScheduledBatch, Scheduler
from ferry.engine.sequence import Sequence
from ferry.engine.slo_hooks import SloHooks
from ferry.model import LoadedModel, load_model
from ferry.protocol import SamplingParams
from ferry.slo.step_model import StepRecord


class LLMEngine(KvHandoff, KvTiers, SloHooks):
    def __init__(self, lm: LoadedModel, config: EngineConfig | None = None) -> None:
        self.lm = lm
        self.config = config = config or EngineConfig()
        num_blocks = config.num_kv_blocks or self._blocks_for_memory(lm, config)
        self.runner = ModelRunner(
            lm,
            num_blocks,
            config.block_size,
            config.device,
            kv_dtype(lm, config),
            config.attention,
            config.max_num_seqs,
        )
        self.copier = KvCopier(self.runner.kv)
        """Every KV block in or out of the pool goes through it, off the engine thread's critical path."""
        self.block_manager = BlockManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.block_manager.on_copy = self._copy_block
        self.scheduler = Scheduler(
            self.block_manager,
            config.max_num_seqs,
            config.max_num_batched_tokens,
            static_batching=config.batching == "static",
            shortest_first=resolve_prefill_order(config.prefill_order) == "shortest",
            split_min_tokens=resolve_prefill_split_tokens(config.prefill_split_tokens),
        )
        self.host: HostTier | None = None
        """Blocks evicted from the pool, kept in host memory (config.host_cache_blocks > 0)."""
        if config.host_cache_blocks:
            cache = HostBlockCache(config.host_cache_blocks, pin_memory=config.device.startswith("cuda"))
            self.host = HostTier(cache, self.block_manager, self.copier)
        self.max_model_len = lm.config.max_position_embeddings
        self.generator = torch.Generator().manual_seed(config.seed)
        self._requests: dict[str, RequestState] = {}
        self._finished_chains: OrderedDict[str, tuple[list[bytes], bytes | None]] = OrderedDict()
        """request id -> (its full blocks' hashes, its partial last block's name) for take_finished_chain."""
        self._max_finished_chains = 0
        self._pinned: dict[str, RequestState] = {}
        self._num_computed_tokens = self._num_steps = self._num_generated = self._num_scheduled = 0
        self.last_step: StepRecord | None = None
        """What the latest non-empty step ran and how long it took (the step-time model learns from it)."""

    def warmup(self) -> None:
        """Compile / build the kernels and capture the decode graphs now, before the engine takes work
        (the worker calls it before it pulls its first request)."""
        self.runner.warmup()

    @classmethod
    def from_model_path(cls, path: str | Path, config: EngineConfig | None = None) -> LLMEngine:
        config = config or EngineConfig()
        lm = load_model(path, device=config.device, dtype=config.dtype, weights_dtype=config.weights_dtype)
        return cls(lm, config)

    @property
    def kv_namespace(self) -> str:
        """Where this engine's KV blocks live in the KV store: the model fingerprint, plus the cache's
        dtype when that differs from the model's (such blocks only load into a cache of that dtype)."""
        if self.runner.kv.dtype == self.lm.model.model.embed_tokens.weight.dtype:
            return self.lm.fingerprint
        return f"{self.lm.fingerprint}-kv-{self.kv_cache_dtype}"

    @property
    def kv_cache_dtype(self) -> str:
        """The KV pool's dtype, as named in EngineConfig ('float32', 'bfloat16', ...)."""
        return str(self.runner.kv.dtype).removeprefix("torch.")

    @property
    def tokenizer(self):
        return self.lm.tokenizer

    # ---- requests ----------------------------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling: SamplingParams,
        output_token_ids: list[int] | tuple[int, ...] = (),
        arrival_time: float | None = None,
    ) -> None:
        state = self._new_state(request_id, prompt_token_ids, output_token_ids, sampling, arrival_time)
        if self.host is not None:
            self.host.promote(state.seq)
        self._requests[request_id] = state
        self.scheduler.add(state.seq)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Drop a request wherever it is and free its blocks now; None if unknown or finished."""
        state = self._requests.pop(request_id, None) or self._pinned.pop(request_id, None)
        if state is None:
            return None
        self.scheduler.remove(state.seq)  # pinned sequences are detached already: this frees them
        return state.abort()

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    # ---- one step ----------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        started = time.perf_counter()
        batch = self.scheduler.schedule()
        if self.host is not None:
            self.host.flush()  # blocks evicted for this batch, before the step overwrites them
        if batch.is_empty:
            self.runner.idle()  # an expert-parallel rank still joins its group's all-to-alls
            return []
        shape = _step_shape(batch)  # before update: context is what the cache held going in
        logits = self.runner.run(batch)  # [B, vocab]
        self.scheduler.update(batch)
        self._count(batch)
        outputs = self._postprocess(batch, logits)
        self.last_step = StepRecord(*shape, duration_ms=(time.perf_counter() - started) * 1000.0)
        return outputs

    def _postprocess(self, batch: ScheduledBatch, logits: torch.Tensor) -> list[RequestOutput]:
        rows = [i for i, s in enumerate(batch.seqs) if s.num_computed_tokens == s.num_tokens]
        if not rows:
            return []
        states = [self._requests[batch.seqs[i].request_id] for i in rows]
        if len(rows) < len(batch.seqs):  # some rows are mid-prefill chunks: no token for them yet
            logits = logits[rows]
        result = sample(
            logits,
            [s.sample_request() for s in states],
            self.generator,
            fused=self.runner.attention_backend == "cpu",
        )
        outputs = []
        for state, token_id, logprob in zip(states, result.token_ids, result.logprobs):
            outputs.append(state.append(token_id, logprob))
            if state.seq.finish_reason is not None:
                self._finish(state)
            elif self.config.role == "prefill":
                self._pin(state)
        self._num_generated += len(outputs)
        return outputs

    def _finish(self, state: RequestState) -> None:
        seq = state.seq
        del self._requests[seq.request_id]
        if self._max_finished_chains:
            self._finished_chains[seq.request_id] = (
                seq.block_hashes[: seq.num_computed_tokens // self.config.block_size],
                self.block_manager.partial_key(seq),
            )
            while len(self._finished_chains) > self._max_finished_chains:
                self._finished_chains.popitem(last=False)
        self.scheduler.remove(seq)

    def _copy_block(self, src: int, dst: int) -> None:
        """The block manager's copy-on-write of a cached partial block into a new sequence's block."""
        if self.host is not None:
            self.host.flush()  # dst may have just been evicted: its old KV goes to the host first
        self.copier.copy_within(src, dst)

    def _pin(self, state: RequestState) -> None:
        del self._requests[state.seq.request_id]
        self.scheduler.detach(state.seq)
        self._pinned[state.seq.request_id] = state

    def _count(self, batch: ScheduledBatch) -> None:
        self._num_steps += 1
        self._num_scheduled += len(batch.seqs)
        self._num_computed_tokens += sum(batch.num_new_tokens)

    # ---- introspection -----------------------------------------------------------------------
    def stats(self) -> EngineStats:
        sched, bm = self.scheduler, self.block_manager
        return EngineStats(
            num_running=len(sched.running),
            num_waiting=len(sched.waiting),
            num_queued_prefill_tokens=sched.num_queued_prefill_tokens(),
            kv_blocks_used=bm.num_used_blocks,
            kv_blocks_total=bm.num_blocks,
            num_computed_tokens=self._num_computed_tokens,
            num_cached_tokens=bm.num_hit_tokens,
            num_preemptions=sched.num_preemptions,
            num_steps=self._num_steps,
            num_generated_tokens=self._num_generated,
            num_pinned=len(self._pinned),
            mean_batch_size=self._num_scheduled / max(self._num_steps, 1),
            num_host_blocks=len(self.host.cache) if self.host is not None else 0,
            num_host_hit_blocks=self.host.cache.num_hits if self.host is not None else 0,
            num_partial_hit_tokens=bm.num_tail_hit_tokens,
        )

    # ---- internals ---------------------------------------------------------------------------
    def _new_state(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        output_token_ids,
        sampling: SamplingParams,
        arrival_time: float | None,
    ) -> RequestState:
        if request_id in self._requests or request_id in self._pinned:
            raise ValueError(f"request_id={request_id!r}: already in the engine")
        if not prompt_token_ids:
            raise ValueError("prompt_token_ids: must not be empty")
        if sampling.stop and not self.config.detokenize:
            raise ValueError("sampling.stop: stop strings need text, and this engine has detokenize=False")
        tokens = list(prompt_token_ids) + list(output_token_ids)
        vocab = self.lm.config.vocab_size
        bad = next((t for t in tokens if not (isinstance(t, int) and 0 <= t < vocab)), None)
        if bad is not None:  # an embedding lookup would raise mid-step and take the whole batch down
            raise ValueError(f"prompt_token_ids: token id {bad!r} is outside the vocabulary [0, {vocab})")
        if len(tokens) >= self.max_model_len:
            raise ValueError(
                f"prompt_token_ids: {len(tokens)} tokens leave no room in the model's "
                f"{self.max_model_len}-token context"
            )
        seq = Sequence(
            request_id,
            tokens,
            len(prompt_token_ids),
            sampling,
            arrival_time=time.time() if arrival_time is None else arrival_time,
            num_prior_output_tokens=len(output_token_ids),
        )
        tokenizer = self.lm.tokenizer if self.config.detokenize else None
        state = RequestState(seq, tokenizer, self.lm.eos_token_ids, self.max_model_len)
        seq.max_num_tokens = state.max_num_tokens
        if state.finished_before_start:
            raise ValueError(f"sampling.max_tokens={sampling.max_tokens}: already reached by output_token_ids")
        if self.block_manager.blocks_for(state.max_num_tokens) > self.block_manager.num_blocks:
            raise ValueError(
                f"sampling.max_tokens={sampling.max_tokens}: prompt + output need more KV blocks "
                f"than the pool's {self.block_manager.num_blocks}"
            )
        return state

    @staticmethod
    def _blocks_for_memory(lm: LoadedModel, config: EngineConfig) -> int:
        per_block = ModelRunner.block_bytes(lm, config.block_size, kv_dtype(lm, config))
        return max(1, int(config.kv_cache_memory_gb * 2**30 // per_block))


def _step_shape(batch: ScheduledBatch) -> tuple[int, int, int]:
    """(sequences, prefill tokens, context tokens read) of a scheduled batch, before it runs."""
    prefill = sum(n for seq, n in zip(batch.seqs, batch.num_new_tokens) if not seq.is_prefill_done)
    return len(batch.seqs), prefill, sum(seq.num_computed_tokens for seq in batch.seqs)


def kv_dtype(lm: LoadedModel, config: EngineConfig) -> torch.dtype | None:
    """The KV cache's dtype: config.kv_cache_dtype when given; unset, bfloat16 for an fp32 model with
    quantized weights on the CPU (its numerics are already the codes', and CPU decode attention is bound by
    the bytes of K/V it reads: half of them made a SmolLM2 burst 14-20% faster), else None (the model's)."""
    if config.kv_cache_dtype:
        return getattr(torch, config.kv_cache_dtype)
    quantized = lm.weights_dtype.startswith("int")
    on_cpu = torch.device(config.device).type == "cpu"
    if quantized and on_cpu and lm.model.model.embed_tokens.weight.dtype == torch.float32:
        return torch.bfloat16
    return None
