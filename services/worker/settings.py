"""Worker settings, from `FERRY_*` environment variables."""

from __future__ import annotations

from pydantic import Field, field_validator, model_validator

from ferry.dtypes import KV_CACHE_DTYPES, WEIGHTS_DTYPES, check_dtype_name
from ferry.engine.config import WORKER_HOST_KV_BLOCKS, WORKER_NUM_KV_BLOCKS
from ferry.model.source import served_name
from ferry.settings import ServiceSettings, default_instance_id


class WorkerSettings(ServiceSettings):
    role: str = Field(
        default="prefill",
        pattern=r"^(prefill|decode|both)$",
        description="prefill, decode, or both: prefill work decoded by the same worker (no hand-off)",
    )
    model: str = Field(
        default="", description="checkpoint folder (config.json + safetensors + tokenizer), .gguf file or smollm2"
    )
    served_model_name: str = Field(default="", description="model name clients use; default: folder name")
    worker_id: str = Field(
        default_factory=default_instance_id,
        pattern=r"^[A-Za-z0-9_-]+$",
        description="names this worker's subjects and consumer; unique per replica",
    )
    kv_writeback: bool = Field(
        default=True,
        description="decode: when a sequence finishes, write the full blocks it added (its output) to the KV "
        "store, so the next turn of the conversation finds its whole history there",
    )
    handoff_skip_stored: bool = Field(
        default=True,
        description="a hand-off writes only the blocks after the leading ones the KV store holds already (one "
        "EXISTS round trip first): a conversation's later turns do not rewrite their whole history",
    )
    kv_writeback_delay_s: float = Field(
        default=0.0,
        ge=0,
        description="0: a write-back runs at once. > 0: it waits while the engine has work (it runs once the "
        "engine is idle), at most this long, so under a burst of single-turn requests the running sequences' "
        "steps keep the cores (+9% ferry up burst throughput on 2 cores at 5 s); but the next turn of a "
        "conversation then finds no history to prefetch while the worker stays busy (multi-turn prefetch lost)",
    )
    num_kv_blocks: int = Field(default=WORKER_NUM_KV_BLOCKS, ge=1, description="blocks in this worker's KV pool")
    block_size: int = Field(default=16, ge=1, description="tokens per KV block")
    host_kv_blocks: int = Field(
        default=WORKER_HOST_KV_BLOCKS,
        ge=0,
        description="host tier: blocks evicted from the KV pool kept in host memory (pinned on a GPU) "
        "and loaded back instead of fetched or recomputed; prefetched blocks land here too; 0 = off",
    )
    max_running: int = Field(default=64, ge=1, description="most sequences in the engine at once")
    stream_interval_ms: float = Field(
        default=0.0,
        ge=0,
        description="hold a stream's token events up to this long and send them as one event (the first and "
        "the last token go at once): fewer messages, SSE events and client reads per token; 0 = every step",
    )
    max_batch_tokens: int = Field(default=2048, ge=1, description="token budget of one engine step")
    pull_ahead_tokens: int = Field(
        default=16384,
        ge=0,
        description="prefill and both roles: the worker stops pulling while this many prompt tokens (at least "
        "max_batch_tokens) are pulled and not yet prefilled; the rest waits in JetStream, still routed to this "
        "worker. The engine orders prefills (FERRY_PREFILL_ORDER) only among the prompts it holds, so pulling a "
        "burst ahead lets its shortest prompts go first (issue #22); 0 = one step's worth (max_batch_tokens)",
    )
    admission_window_ms: float = Field(
        default=20.0,
        ge=0,
        description="prefill and both roles: a step that would not fill max_batch_tokens waits up to this long "
        "for prompts known to be on their way (pulled, or queued in JetStream behind the last one pulled), so a "
        "burst's prompts are prefilled together; a lone request never waits; 0 = off",
    )
    admission_burst_ms: float = Field(
        default=150.0,
        ge=0,
        description="prefill and both roles: an idle engine's first step (the start of a burst) waits up to this "
        "long (at least admission_window_ms) for prompts on their way, also those the balancer has not routed yet, "
        "and, once one arrived during the wait, while the burst keeps arriving (the last one less than "
        "admission_window_ms ago), past max_batch_tokens: so that it does not run the burst's first prompt alone "
        "and picks its prompts (FERRY_PREFILL_ORDER) among the whole burst; the window's 0 turns this off too",
    )
    pipeline_depth: int = Field(
        default=2,
        ge=1,
        le=2,
        description="pipelined roles (both, decode): engine steps queued on the engine thread while the asyncio "
        "thread handles the last one's outputs. 2: when a step ends the next is already queued, so the engine thread "
        "never waits for a hop through the asyncio thread (~1 ms a step on 2 busy cores); an addition or abort still "
        "runs before the next step (compute.py). 1: each step is queued when the one before it returns",
    )
    loop_sched_batch_from: int = Field(
        default=4,
        ge=0,
        description="Linux: from this many sequences in a step the asyncio thread (NATS, token events, pulls) runs "
        "SCHED_BATCH, back to the normal policy under half of it: the messages that wake it then do not preempt the "
        "engine's OpenMP threads mid-step (a preempted thread stalls its team at the next barrier); at low load it "
        "keeps waking at once (ferry.sched). 0: never",
    )
    max_num_seqs: int | None = Field(
        default=None,
        ge=1,
        description="a fixed running-sequence cap: no SLO controller (unset: max_running, adaptive when "
        "FERRY_TPOT_SLO_MS is set)",
    )
    tpot_slo_ms: float = Field(
        default=0.0,
        ge=0,
        description="inter-token latency target; > 0 turns on the SLO controller (cap and chunk budget per step)",
    )
    ttft_slo_ms: float = Field(default=2000.0, gt=0, description="time-to-first-token target of the SLO controller")
    load_interval_s: float = Field(default=1.0, gt=0, description="seconds between load reports")
    device: str = Field(default="cpu", description="torch device: cpu, cuda, cuda:1, ...")
    dtype: str = Field(default="", description="model dtype (float32, bfloat16, ...); '' keeps the checkpoint's")
    weights_dtype: str = Field(
        default="auto",
        description="how projection weights are held: auto keeps the checkpoint's, int8/int4 quantize them "
        "group-wise at load (a quarter/an eighth of fp32's bytes per decode step); part of the KV namespace",
    )
    kv_cache_dtype: str = Field(
        default="",
        description="KV cache dtype; '' = the model's, except bfloat16 for int8/int4 weights on the CPU. "
        "bfloat16 under an fp32 model halves KV memory and CPU decode attention's reads; every worker of a "
        "deployment should use the same. float8_e4m3fn (CPU only) quarters fp32's bytes",
    )
    ep_size: int = Field(
        default=1,
        ge=1,
        description="expert parallelism: this worker is a group of ep_size rank processes holding one MoE "
        "model (routed experts split, attention data-parallel: each rank its own sequences and KV pool of "
        "num_kv_blocks); it must divide the model's routed experts",
    )
    handoff_timeout_s: float = Field(
        default=60.0, gt=0, description="prefill: how long to retry a hand-off nobody takes"
    )
    ack_wait_s: float = Field(default=30.0, gt=0, description="JetStream lease of a pulled message")
    shutdown_grace_s: float = Field(
        default=20.0,
        ge=0,
        description="on SIGTERM, how long running requests get to finish before they are handed on "
        "(decode) or given back to the gateway to resubmit (prefill); keep it a few seconds under the orchestrator's "
        "stop grace period (compose stop_grace_period, k8s terminationGracePeriodSeconds)",
    )

    @field_validator("weights_dtype")
    @classmethod
    def _weights_dtype(cls, value: str) -> str:
        if value not in WEIGHTS_DTYPES:
            raise ValueError(f"weights_dtype: unsupported {value!r}, expected one of {WEIGHTS_DTYPES}")
        return value

    @field_validator("kv_cache_dtype")
    @classmethod
    def _kv_cache_dtype(cls, value: str) -> str:
        return value and check_dtype_name(value, "kv_cache_dtype", KV_CACHE_DTYPES)

    @model_validator(mode="after")
    def _group(self) -> WorkerSettings:
        if self.ep_size > 1 and self.is_adaptive:
            raise ValueError("ep_size > 1: the SLO controller (tpot_slo_ms) does not drive worker groups yet")
        return self

    @property
    def work_role(self) -> str:
        """The role whose work subjects, consumer and load reports this worker uses ('both' pulls prefill work)."""
        return "prefill" if self.role == "both" else self.role

    @property
    def is_adaptive(self) -> bool:
        """The SLO controller sets the cap and chunk budget (a TPOT target, no fixed cap)."""
        return self.tpot_slo_ms > 0 and self.max_num_seqs is None

    @property
    def model_name(self) -> str:
        """The name clients send in `model` (the gateway's default is the same folder name)."""
        return self.served_model_name or served_name(self.model) or "ferry"
