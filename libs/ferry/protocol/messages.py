"""Every message that crosses the bus, defined once.

Fields with defaults may be absent on the wire; a field is only ever added with a default, so
older receivers keep working. Range checks live in `__post_init__` and raise `ValueError` naming
the field; the codec turns that into a `ProtocolError` on receipt.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ferry.protocol.codec import message

ROLES = ("prefill", "decode")
FINISH_REASONS = ("stop", "length", "abort")


@dataclass(slots=True)
class SamplingParams:
    """How to pick tokens and when to stop. Shared by the gateway, the workers and the engine."""

    max_tokens: int = 16
    """Most tokens to generate (the prompt excluded)."""
    min_tokens: int = 0
    """EOS and stop token ids are suppressed until this many tokens are generated."""
    temperature: float = 1.0
    """0 means greedy."""
    top_p: float = 1.0
    """Nucleus sampling: keep the smallest set of tokens whose probability sums to top_p."""
    top_k: int = 0
    """Keep the k most likely tokens; 0 keeps all."""
    min_p: float = 0.0
    """Drop tokens less likely than min_p times the most likely one."""
    seed: int | None = None
    """Per-request seed; the result does not depend on the rest of the batch."""
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    """1.0 is off; > 1 discourages tokens already in prompt or output."""
    stop: list[str] = field(default_factory=list)
    """Stop strings: generation ends before the first occurrence, which is not emitted."""
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None
    """None: no logprobs. k >= 0: the sampled token's logprob plus the k most likely."""

    def __post_init__(self) -> None:
        _require(self.max_tokens >= 1, "max_tokens", self.max_tokens, "must be >= 1")
        _require(self.min_tokens >= 0, "min_tokens", self.min_tokens, "must be >= 0")
        _require(self.temperature >= 0, "temperature", self.temperature, "must be >= 0")
        _require(0 < self.top_p <= 1, "top_p", self.top_p, "must be in (0, 1]")
        _require(self.top_k >= 0, "top_k", self.top_k, "must be >= 0 (0 = off)")
        _require(0 <= self.min_p <= 1, "min_p", self.min_p, "must be in [0, 1]")
        _require(-2 <= self.presence_penalty <= 2, "presence_penalty", self.presence_penalty, "must be in [-2, 2]")
        _require(-2 <= self.frequency_penalty <= 2, "frequency_penalty", self.frequency_penalty, "must be in [-2, 2]")
        _require(self.repetition_penalty > 0, "repetition_penalty", self.repetition_penalty, "must be > 0")
        _require(self.logprobs is None or 0 <= self.logprobs <= 20, "logprobs", self.logprobs, "must be in [0, 20]")
        _require(all(s for s in self.stop), "stop", self.stop, "must not contain empty strings")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0


@dataclass(slots=True)
class GenerateRequest:
    """One user request as it travels from the gateway through prefill to decode."""

    request_id: str
    gateway_id: str
    """Token events go to `ferry.out.<gateway_id>`."""
    model: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    output_token_ids: list[int] = field(default_factory=list)
    """Tokens already streamed to the client. After a migration the new worker continues after
    them: its KV covers prompt + these, and its next event starts at index len(output_token_ids)."""
    arrival_time: float = 0.0
    """Unix time at which the gateway accepted the request."""
    attempt: int = 0
    """0 for the first try; incremented on every migration."""

    def __post_init__(self) -> None:
        _require(bool(self.request_id), "request_id", self.request_id, "must not be empty")
        _require(_is_token(self.gateway_id), "gateway_id", self.gateway_id, "must be a subject token")
        _require(len(self.prompt_token_ids) >= 1, "prompt_token_ids", "[]", "must not be empty")

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids


@message("submit")
@dataclass(slots=True)
class SubmitRequest:
    """gateway -> prefill-balancer on `ferry.submit` (request/reply)."""

    request: GenerateRequest


@message("submit_reply")
@dataclass(slots=True)
class SubmitReply:
    """prefill-balancer -> gateway: accepted, or rejected with a reason."""

    request_id: str
    accepted: bool
    worker_id: str = ""
    reason: str = ""
    """Why it was rejected: 'overloaded' (HTTP 429), 'no_workers' (503), or a bad-request text."""
    retry_after_s: float = 0.0


@message("prefill_work")
@dataclass(slots=True)
class PrefillWork:
    """prefill-balancer -> prefill worker on JetStream `ferry.work.prefill.<worker>`."""

    request: GenerateRequest
    routed_at: float = 0.0
    num_cached_blocks_hint: int = 0
    """Blocks of the prompt the balancer believed cached on this worker or in the store (its routing
    reason), rounded up: 0 means none known, and the worker then skips its store lookup."""
    num_routing_behind: int = 0
    """Submits queued at the balancer behind this one when it was published (more of a burst on its
    way, not yet in JetStream), this worker's share of them (divided by the routable workers, rounded up):
    the worker's admission window holds an idle engine's first step for them."""

    def __post_init__(self) -> None:
        _require(self.num_routing_behind >= 0, "num_routing_behind", self.num_routing_behind, "must be >= 0")


@dataclass(slots=True)
class BlockRef:
    """One KV block in the store: its chained hash and how many tokens it holds."""

    block_hash: bytes
    num_tokens: int

    def __post_init__(self) -> None:
        _require(len(self.block_hash) == 16, "block_hash", len(self.block_hash), "must be 16 bytes")
        _require(self.num_tokens >= 1, "num_tokens", self.num_tokens, "must be >= 1")


@message("handoff")
@dataclass(slots=True)
class Handoff:
    """prefill worker -> decode-balancer (`ferry.handoff`) -> decode worker (`ferry.work.decode.<w>`).

    `request.output_token_ids` already holds the first token. `kv_blocks` cover the KV of the
    first `num_kv_tokens` tokens of prompt + output, in order; the last block may be partial."""

    request: GenerateRequest
    prefill_worker_id: str
    kv_namespace: str
    """Model fingerprint: blocks of another model never load."""
    kv_blocks: list[BlockRef]
    num_kv_tokens: int
    decode_worker_id: str = ""
    """Set by the decode-balancer when it routes the hand-off."""

    def __post_init__(self) -> None:
        total = sum(b.num_tokens for b in self.kv_blocks)
        _require(
            total == self.num_kv_tokens,
            "num_kv_tokens",
            self.num_kv_tokens,
            f"must equal the tokens in kv_blocks ({total})",
        )


@message("handoff_reply")
@dataclass(slots=True)
class HandoffReply:
    request_id: str
    accepted: bool
    worker_id: str = ""
    reason: str = ""
    """Why not, when not accepted: 'overloaded' and 'no_workers' pass (try again), one starting with
    HANDOFF_TOO_LONG does not (no decode worker's whole pool holds the sequence)."""


HANDOFF_TOO_LONG = "too_long"
"""HandoffReply.reason's prefix when no decode worker could ever take the sequence: retrying cannot help."""


@dataclass(slots=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top_token_ids: list[int] = field(default_factory=list)
    top_logprobs: list[float] = field(default_factory=list)


@dataclass(slots=True)
class TokenEvent:
    """New tokens of one request from one engine step (usually one token; several on catch-up)."""

    request_id: str
    index: int
    """Position of token_ids[0] in the request's output; lets the gateway drop duplicates."""
    token_ids: list[int]
    text: str = ""
    """Detokenized text of these tokens (never half a UTF-8 character; stop strings removed)."""
    logprobs: list[TokenLogprob] | None = None
    finish_reason: str | None = None
    """None while running; 'stop', 'length' or 'abort' on the last event."""
    num_prompt_tokens: int = 0
    attempt: int = 0
    """`GenerateRequest.attempt` that produced it: after a migration the gateway ignores older attempts."""

    def __post_init__(self) -> None:
        _require(self.index >= 0, "index", self.index, "must be >= 0")
        _require(
            self.finish_reason in (None, *FINISH_REASONS),
            "finish_reason",
            self.finish_reason,
            f"must be one of {FINISH_REASONS}",
        )


@dataclass(slots=True)
class ErrorEvent:
    """A request failed somewhere downstream of the gateway."""

    request_id: str
    code: str
    """'worker_lost', 'overloaded', 'bad_request', 'internal', 'kv_transfer'."""
    message: str
    retryable: bool = False
    attempt: int = 0


@message("output")
@dataclass(slots=True)
class OutputBatch:
    """worker -> gateway on `ferry.out.<gateway>`: every event for that gateway from one step."""

    worker_id: str
    tokens: list[TokenEvent] = field(default_factory=list)
    errors: list[ErrorEvent] = field(default_factory=list)


@message("cancel")
@dataclass(slots=True)
class Cancel:
    """gateway -> everyone on `ferry.cancel`: stop these requests and free their blocks."""

    request_ids: list[str]
    reason: str = "client_disconnected"
    below_attempt: int | None = None
    """None: cancel every attempt. n: only attempts < n (the stale copies of a migrated request)."""


@dataclass(slots=True)
class RankLoad:
    """One rank of an expert-parallel worker group (`FERRY_EP_SIZE`): its own sequences and KV pool."""

    rank: int
    num_running: int
    num_waiting: int
    num_queued_prefill_tokens: int
    """Prompt tokens dealt to this rank whose KV is not computed yet."""
    queued_prefill_attention: float
    """Core-attention work of those tokens: token pairs (sum over prompts of tokens x context)."""
    kv_blocks_used: int
    kv_blocks_total: int
    max_running: int
    """This rank's batch cap."""

    def __post_init__(self) -> None:
        _require(self.rank >= 0, "rank", self.rank, "must be >= 0")
        _require(self.kv_blocks_total >= 0, "kv_blocks_total", self.kv_blocks_total, "must be >= 0")


@message("load")
@dataclass(slots=True)
class LoadReport:
    """worker -> balancers on `ferry.load.<role>.<worker>`, every `interval_s`."""

    worker_id: str
    role: str
    model: str
    kv_namespace: str
    timestamp: float
    interval_s: float
    num_running: int
    num_waiting: int
    num_queued_prefill_tokens: int
    kv_blocks_used: int
    kv_blocks_total: int
    max_running: int
    block_size: int = 16
    draining: bool = False
    """True while shutting down: route nothing new here."""
    num_backlog: int = 0
    """Work messages queued for this worker in JetStream and not pulled yet (its consumer's pending
    count): a worker pulls only what fits its budget, so without this a balancer sees a full
    worker's queue only until the next report and never finds every worker full ('overloaded')."""
    decodes: bool = False
    """A prefill worker that also decodes what it prefilled (`FERRY_ROLE=both`): no hand-off leaves
    it, and the gateway counts it as a decode worker too."""
    weights_dtype: str = ""
    """What the worker's weight matmuls hold (float32, bfloat16, int8, ...; '' = not said)."""
    ranks: list[RankLoad] = field(default_factory=list)
    """A worker group's ranks, rank 0 first (empty: a single-process worker). The totals above are
    the group's; balancers weigh the rank a new sequence would land on."""
    started_at: float = 0.0
    """When this worker process started (wall clock; 0 = not said). Another value under the same worker id
    means it restarted: its pool is empty, whatever a balancer noted of it before (session affinity)."""

    def __post_init__(self) -> None:
        _require(self.role in ROLES, "role", self.role, f"must be one of {ROLES}")
        _require(self.num_backlog >= 0, "num_backlog", self.num_backlog, "must be >= 0")
        _require(_is_token(self.worker_id), "worker_id", self.worker_id, "must be a subject token")
        _require(self.kv_blocks_total >= 0, "kv_blocks_total", self.kv_blocks_total, "must be >= 0")
        _require(self.interval_s > 0, "interval_s", self.interval_s, "must be > 0")

    @property
    def kv_usage(self) -> float:
        return self.kv_blocks_used / self.kv_blocks_total if self.kv_blocks_total else 1.0


@message("forecast")
@dataclass(slots=True)
class TrafficForecast:
    """gateway / prefill-balancer -> anyone on `ferry.forecast.<source>`: the arrivals it measured
    and a short-horizon forecast of them (ferry.slo.forecast), every report interval."""

    source: str
    """Who measured: '<service>-<instance>' (a subject token)."""
    timestamp: float
    interval_s: float
    """Arrivals are counted per interval of this length."""
    rate_rps: float
    """Requests/s now (EWMA of closed intervals)."""
    forecast_rps: float
    """The highest rate forecast within horizon_s (Holt-Winters once a season is seen)."""
    horizon_s: float
    mean_prompt_tokens: float
    mean_output_tokens: float
    """Requested output tokens per request (max_tokens), an EWMA."""
    num_requests: int = 0
    """Requests seen since the source started."""
    is_seasonal: bool = False
    """True once a whole season (a day) has been seen: forecast_rps follows the day-night shape."""

    def __post_init__(self) -> None:
        _require(_is_token(self.source), "source", self.source, "must be a subject token")
        _require(self.interval_s > 0, "interval_s", self.interval_s, "must be > 0")
        for name in ("rate_rps", "forecast_rps", "horizon_s", "mean_prompt_tokens", "mean_output_tokens"):
            _require(getattr(self, name) >= 0, name, getattr(self, name), "must be >= 0")
        _require(self.num_requests >= 0, "num_requests", self.num_requests, "must be >= 0")


KV_TIERS = ("device", "host", "remote")
"""Where a KV block can be, fastest first: a worker's pool, its host memory, the shared store."""


@message("kv_event")
@dataclass(slots=True)
class KvEvent:
    """Blocks appeared in or left a pool or the store, on `ferry.kv.events`."""

    kind: str
    """'stored', 'removed' or 'cleared' (every block of the namespace at `where` is gone)."""
    kv_namespace: str
    where: str
    """'store' for the shared Redis store, else the worker id whose pool changed."""
    block_hashes: list[bytes] = field(default_factory=list)
    timestamp: float = 0.0
    tier: str = "device"
    """Which memory of `where`: 'device' (a worker's KV pool), 'host' (the blocks a worker evicted
    from its pool, kept in host memory) or 'remote' (the store)."""

    def __post_init__(self) -> None:
        _require(
            self.kind in ("stored", "removed", "cleared"), "kind", self.kind, "must be 'stored', 'removed' or 'cleared'"
        )
        _require(self.tier in KV_TIERS, "tier", self.tier, f"must be one of {KV_TIERS}")


@message("kv_prefetch")
@dataclass(slots=True)
class KvPrefetch:
    """Blocks a routed request will need, sent to the worker it was routed to on `ferry.kv.prefetch.<id>`
    so the worker can fetch them from the store into its host tier while the request is queued."""

    request_id: str
    """Cancelling this request cancels the prefetch."""
    kv_namespace: str
    block_hashes: list[bytes]
    """Leading blocks of the prompt, in chain order; the worker skips those it holds."""
    warm: bool = False
    """A turn-end warm-up (`KvWarm`): no request waits for it yet, so the worker runs every request's
    prefetch before it."""

    def __post_init__(self) -> None:
        _require(bool(self.block_hashes), "block_hashes", self.block_hashes, "must not be empty")


@message("kv_warm")
@dataclass(slots=True)
class KvWarm:
    """A conversation's turn ended: a decode worker wrote its output blocks back to the store, and tells
    the prefill-balancers (`ferry.kv.warm`, queue group) the whole chain the next turn will start with, so
    that one of them has it prefetched into the prefill worker likeliest to serve that turn (the one
    holding the chain's head) during the user's think time; every decode-balancer hears it too, and
    credits the worker that holds the chain (session affinity)."""

    request_id: str
    """The finished turn (logs only)."""
    kv_namespace: str
    block_hashes: list[bytes]
    """Every full block of prompt + output, in chain order; the tail ones were just written to the store."""
    worker_id: str = ""
    """The worker that served the turn and holds the chain in its pool: decode-balancers route the next
    turn there (session affinity), other things equal."""
    partial_hash: bytes | None = None
    """The name of the turn's partial last block (`hash_partial_block`), written to the store with the
    chain: the next turn extends its tokens, so it is prefetched with the chain."""

    def __post_init__(self) -> None:
        _require(bool(self.block_hashes), "block_hashes", self.block_hashes, "must not be empty")


@message("kv_resync")
@dataclass(slots=True)
class KvResync:
    """On `ferry.kv.resync`, from a prefill-balancer that (re)started with an empty prefix index: every
    prefill worker and the kvcache service publish all they hold as 'stored' `KvEvent`s."""

    requester: str = ""
    """Who asked (logs only)."""


@message("kv_lookup")
@dataclass(slots=True)
class KvLookup:
    """Ask the kvcache service how many leading blocks of a chain are stored."""

    kv_namespace: str
    block_hashes: list[bytes]


@message("kv_lookup_reply")
@dataclass(slots=True)
class KvLookupReply:
    num_cached_blocks: int


@message("kv_stats_request")
@dataclass(slots=True)
class KvStatsRequest:
    """Ask the kvcache service what the store holds, on `ferry.kv.stats`."""

    kv_namespace: str = ""
    """'' for every namespace."""


@message("kv_stats")
@dataclass(slots=True)
class KvStats:
    """kvcache service -> asker: what the store holds and how it is doing."""

    num_blocks: int
    num_bytes: int
    """Bytes of the stored block values (headers included)."""
    num_lookups: int = 0
    lookup_hit_rate: float = 0.0
    """Leading blocks found / blocks asked, over the lookups this service answered."""
    num_evictions: int = 0
    """Blocks Redis evicted (maxmemory) since the service started."""
    degraded: bool = False
    """True while Redis is unreachable; lookups then answer an ErrorReply."""
    max_memory_bytes: int = 0
    """Redis `maxmemory`; 0 = unlimited."""
    eviction_policy: str = ""
    used_memory_bytes: int = 0
    """Redis `used_memory`, everything included."""
    blocks_per_namespace: dict[str, int] = field(default_factory=dict)


@message("error_reply")
@dataclass(slots=True)
class ErrorReply:
    """What a request/reply endpoint answers when its handler failed or the request was invalid."""

    code: str
    message: str


def _is_token(name: str) -> bool:
    """A NATS subject token we allow in names: letters, digits, '-' and '_'."""
    return bool(name) and all(c.isascii() and (c.isalnum() or c in "-_") for c in name)


def _require(ok: bool, name: str, value: object, problem: str) -> None:
    if not ok:
        raise ValueError(f"{name}={value!r} {problem}")
