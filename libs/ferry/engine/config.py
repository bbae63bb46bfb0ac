"""EngineConfig: how big the KV pool is, how many sequences and tokens one step may take."""

from __future__ import annotations

import os
from dataclasses import dataclass

from ferry.dtypes import KV_CACHE_DTYPES, WEIGHTS_DTYPES

BATCHING_MODES = ("dynamic", "static")
ENGINE_ROLES = ("both", "prefill", "decode")
PREFILL_ORDERS = ("shortest", "fcfs")
"""EngineConfig.prefill_order / FERRY_PREFILL_ORDER values."""
ATTENTION_CHOICES = ("auto", "torch", "triton")
"""EngineConfig.attention / FERRY_ATTENTION values; ferry.kernels.backend resolves them for a device."""
WORKER_NUM_KV_BLOCKS = 1024
"""A worker's KV pool by default (FERRY_NUM_KV_BLOCKS); benchmarks of the engine alone use it too, so
that both sides of engine-vs-system hold the same."""
WORKER_HOST_KV_BLOCKS = 256
"""A worker's host tier by default (FERRY_HOST_KV_BLOCKS)."""


@dataclass(slots=True)
class EngineConfig:
    block_size: int = 16
    """Tokens per KV block: a power of two (a Triton tile dimension), at least 16 on a GPU."""
    num_kv_blocks: int | None = None
    """Blocks in the KV pool; None sizes the pool from kv_cache_memory_gb."""
    kv_cache_memory_gb: float = 1.0
    """Memory for the KV pool when num_kv_blocks is None."""
    max_num_seqs: int = 64
    """Most sequences running at once (the decode batch cap)."""
    max_num_batched_tokens: int = 2048
    """Token budget of one step: decodes (1 each) plus prefill chunks."""
    enable_prefix_caching: bool = True
    prefill_order: str | None = None
    """Which waiting prompts a step admits first, one of PREFILL_ORDERS: 'shortest' (the shortest prompt first; one
    that an admission passed over goes first at the next, so none waits more than one extra admission) or 'fcfs'
    (arrival order); None reads FERRY_PREFILL_ORDER (default 'shortest'; vLLM's default is 'fcfs'). Why
    'shortest': under a burst more prompts finish in the first prefill steps (SmolLM2's 48-request burst in the
    engine, unbounded: TTFT p50 1.32-1.44 -> 0.62 s at the same tok/s, ops/bench/throughput/reports/20261205-
    prefill/engine_ab.txt). Dynamic batching only."""
    prefill_split_tokens: int | None = None
    """With prefill_order 'shortest': an admission that finds only fresh prompts waiting takes the shortest of
    them up to half of their tokens, at least this many (scheduler.py), so a burst of one or two steps' worth
    gets most first tokens out of a step half as long; 0 = fill the step budget; None reads
    FERRY_PREFILL_SPLIT_TOKENS (default 512). Why: SmolLM2's 24-request bursts through `ferry up` on the Xeon
    box, TTFT p50 969 -> 680 ms at 278.5 -> 286.0 tok/s (this setting off -> on, mean of 4 bursts each, one
    call); the 48 burst (over two steps' worth: its first step fills the budget as before) and Poisson 3 req/s
    measured the same (ops/bench/throughput/reports/20261205x-xeon-first-steps)."""
    batching: str = "dynamic"
    """'dynamic': iteration-level (continuous) batching; 'static': fill a batch, run it to
    completion, then the next (the baseline)."""
    role: str = "both"
    """'prefill': a request stops after its first token and its KV stays pinned for take_prefilled."""
    device: str = "cpu"
    """'cpu', 'cuda' or 'cuda:N': the engine's calls run under a guard for that device, on any thread."""
    attention: str | None = None
    """Attention implementation: 'auto' (Triton on CUDA, else the CPU path), 'torch' or 'triton';
    None reads FERRY_ATTENTION. Resolved once when the engine is built (ferry.kernels.backend)."""
    dtype: str | None = None
    """Model dtype; None keeps the checkpoint's."""
    weights_dtype: str = "auto"
    """How projection weights are held, one of WEIGHTS_DTYPES: 'auto' keeps the checkpoint's, float32 /
    bfloat16 set the model dtype, int8 / int4 quantize them group-wise at load (ferry.model.quant_linear)."""
    kv_cache_dtype: str | None = None
    """dtype of the paged KV cache, one of KV_CACHE_DTYPES; None: the model's, except bfloat16 for an fp32
    model with int8/int4 weights on the CPU (llm_engine.kv_dtype; 'float32' keeps fp32 there). 'bfloat16'
    under an fp32 model halves the memory per cached token and the bytes CPU decode attention reads (the
    fused kernel widens rows in registers and still computes in fp32); keys and values are rounded to bf16
    once, when written. Blocks then live in their own KV-store namespace (LLMEngine.kv_namespace).
    'float8_e4m3fn' (CPU only, opt-in) quarters fp32's bytes: K/V saturate to +-448 and keep 3 mantissa bits, no
    scales; SmolLM2's teacher-forced argmax agreement with a bf16 cache is in ops/bench/throughput/README.md."""
    host_cache_blocks: int = 0
    """Host tier: up to this many blocks evicted from the KV pool are kept in host memory (pinned on
    a GPU) and loaded back at admission instead of recomputed or fetched (engine/host_tier.py); 0 = off."""
    seed: int = 0
    """Seed of the engine's generator for requests without their own seed."""
    detokenize: bool = True
    """False: outputs carry token ids only (text is ''), saving the per-token incremental decode
    (benchmarks, token-in/token-out callers); requests with stop strings are then refused."""

    def __post_init__(self) -> None:
        _require(self.block_size >= 1, "block_size", self.block_size, "must be >= 1")
        _require(self.block_size & (self.block_size - 1) == 0, "block_size", self.block_size, "must be a power of 2")
        _require(
            not self.device.startswith("cuda") or self.block_size >= 16,
            "block_size",
            self.block_size,
            "must be >= 16 on a GPU (the Triton kernels' tile)",
        )
        _require(
            self.attention is None or self.attention in ATTENTION_CHOICES,
            "attention",
            self.attention,
            f"must be None or one of {ATTENTION_CHOICES}",
        )
        _require(
            self.num_kv_blocks is None or self.num_kv_blocks >= 1,
            "num_kv_blocks",
            self.num_kv_blocks,
            "must be >= 1 or None",
        )
        _require(self.kv_cache_memory_gb > 0, "kv_cache_memory_gb", self.kv_cache_memory_gb, "must be > 0")
        _require(self.max_num_seqs >= 1, "max_num_seqs", self.max_num_seqs, "must be >= 1")
        _require(
            self.max_num_batched_tokens >= self.max_num_seqs,
            "max_num_batched_tokens",
            self.max_num_batched_tokens,
            f"must be >= max_num_seqs ({self.max_num_seqs})",
        )
        _require(self.host_cache_blocks >= 0, "host_cache_blocks", self.host_cache_blocks, "must be >= 0")
        _require(
            self.prefill_order is None or self.prefill_order in PREFILL_ORDERS,
            "prefill_order",
            self.prefill_order,
            f"must be None or one of {PREFILL_ORDERS}",
        )
        _require(
            self.prefill_split_tokens is None or self.prefill_split_tokens >= 0,
            "prefill_split_tokens",
            self.prefill_split_tokens,
            "must be None or >= 0",
        )
        _require(self.batching in BATCHING_MODES, "batching", self.batching, f"must be one of {BATCHING_MODES}")
        _require(self.role in ENGINE_ROLES, "role", self.role, f"must be one of {ENGINE_ROLES}")
        _require(
            self.weights_dtype in WEIGHTS_DTYPES,
            "weights_dtype",
            self.weights_dtype,
            f"must be one of {WEIGHTS_DTYPES}",
        )
        _require(
            self.kv_cache_dtype is None or self.kv_cache_dtype in KV_CACHE_DTYPES,
            "kv_cache_dtype",
            self.kv_cache_dtype,
            f"must be None or one of {KV_CACHE_DTYPES}",
        )
        _require(
            self.kv_cache_dtype != "float8_e4m3fn" or (self.device.startswith("cpu") and self.attention != "triton"),
            "kv_cache_dtype",
            self.kv_cache_dtype,
            f"runs on the CPU only (device={self.device!r}, attention={self.attention!r}): the Triton kernels "
            "do not read fp8",
        )


def resolve_prefill_order(order: str | None) -> str:
    """EngineConfig.prefill_order, None read from FERRY_PREFILL_ORDER (default 'shortest')."""
    if order is not None:
        return order
    raw = os.environ.get("FERRY_PREFILL_ORDER", "shortest").strip()
    if raw not in PREFILL_ORDERS:
        raise ValueError(f"FERRY_PREFILL_ORDER={raw!r}: must be one of {PREFILL_ORDERS}")
    return raw


def resolve_prefill_split_tokens(tokens: int | None) -> int:
    """EngineConfig.prefill_split_tokens, None read from FERRY_PREFILL_SPLIT_TOKENS (default 512)."""
    if tokens is not None:
        return tokens
    raw = os.environ.get("FERRY_PREFILL_SPLIT_TOKENS", "512").strip()
    if not raw.isdigit():
        raise ValueError(f"FERRY_PREFILL_SPLIT_TOKENS={raw!r}: must be an integer >= 0")
    return int(raw)


def _require(ok: bool, name: str, value: object, problem: str) -> None:
    if not ok:
        raise ValueError(f"EngineConfig.{name}={value!r}: {problem}")
