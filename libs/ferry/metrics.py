"""Every Prometheus metric ferry exports, defined once, and the /metrics HTTP server.

Services import the objects below and update them; nothing else defines a ferry metric, so the
Grafana dashboard (ops/grafana) and the Prometheus rules can rely on these names. Names and labels
are a public interface: add new ones freely, never rename or relabel an existing one.

| name | type | labels | who updates it |
|---|---|---|---|
| ferry_requests_running | gauge | role | workers: sequences in the running batch |
| ferry_requests_waiting | gauge | role | workers: sequences queued in the engine, not yet scheduled |
| ferry_requests_total | counter | finish_reason | gateway: finished requests (stop, length, abort, error) |
| ferry_time_to_first_token_seconds | histogram | | gateway: request accepted -> first token sent |
| ferry_inter_token_latency_seconds | histogram | | gateway: gap between consecutive token events of one request |
| ferry_e2e_request_latency_seconds | histogram | | gateway: request accepted -> finish sent |
| ferry_prompt_tokens_total | counter | | gateway: prompt tokens of accepted requests |
| ferry_generation_tokens_total | counter | | gateway: tokens streamed to clients |
| ferry_kv_cache_usage_ratio | gauge | role | workers: used / total paged KV blocks, 0..1 |
| ferry_prefix_cache_queries_total | counter | role | workers: prompt tokens looked up in the prefix cache |
| ferry_prefix_cache_hits_total | counter | role | workers: of those, tokens found cached (hit rate = hits / queries) |
| ferry_kv_store_lookups_total | counter | | kvcache: blocks asked for in prefix lookups |
| ferry_kv_store_hits_total | counter | | kvcache: blocks found stored in Redis |
| ferry_kv_store_used_bytes | gauge | | kvcache: Redis used_memory (INFO), sampled every FERRY_KV_HEALTH_INTERVAL_S |
| ferry_kv_store_max_bytes | gauge | | kvcache: Redis maxmemory (0 = unlimited) |
| ferry_kv_store_evictions_total | counter | | kvcache: blocks Redis evicted to stay under maxmemory |
| ferry_batch_size | histogram | role | workers: sequences in one engine step |
| ferry_worker_queue_depth | gauge | role, worker | balancers: work queued on each worker's JetStream consumer |
| ferry_migrations_total | counter | reason | gateway: requests resubmitted after losing their worker (not errors) |
| ferry_errors_total | counter | service, kind | everyone: errors (kind: exception class, ErrorReply code) |
| ferry_batch_cap | gauge | role | workers: running-sequence cap in force (SLO controller's or fixed) |
| ferry_chunk_budget_tokens | gauge | role | workers: prefill tokens the next step may add (SLO controller) |
| ferry_step_model_ms | gauge | role, term | workers: learned step-time costs (see below) |
| ferry_desired_replicas | gauge | role | workers: replicas of their role the forecast needs within the SLOs |
| ferry_forecast_requests_per_second | gauge | source, kind | gateway: arrivals now (rate), forecast peak (forecast) |
| ferry_slo_requests_total | counter | outcome | gateway: finished requests by SLO outcome (see below) |
| ferry_model_info | gauge | role, model, arch, weights_dtype, checkpoint_dtype | workers: 1 for the model they serve |

Migration reasons: worker_silent (no load reports), tokens_missing, bus_reconnect (the gateway's own
bus), worker_lost (a worker said so). A request that runs out of attempts counts as an error too.

Step model terms (ferry.slo.step_model): overhead, per_seq, per_100_prefill_tokens,
per_1000_context_tokens, residual, predicted_step (the step at the cap in force, p90). SLO outcomes
(FERRY_TPOT_SLO_MS / FERRY_TTFT_SLO_MS at the gateway): met, ttft_missed, tpot_missed, both_missed;
attainment = rate(met) / rate(all outcomes).
ferry_model_info's weights_dtype is what the weight matmuls hold (float32, bfloat16, int8, ...);
checkpoint_dtype what the checkpoint stores (a GGUF's Q4_1, Q8_0, ...; a folder's torch dtype).

Hit rates are ratios of counter rates, e.g.
`rate(ferry_prefix_cache_hits_total[5m]) / rate(ferry_prefix_cache_queries_total[5m])`.

`start_metrics_server(port)` serves every metric (plus the process/platform collectors) on
`http://0.0.0.0:<port>/metrics`; services call it with `settings.metrics_port` (0 = off).
"""

from __future__ import annotations

from wsgiref.simple_server import WSGIServer

from prometheus_client import REGISTRY, Counter, Gauge, Histogram, start_http_server

# Latency buckets span a tiny CPU model (ms) to a long generation on a loaded cluster (minutes).
TTFT_BUCKETS_S = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
ITL_BUCKETS_S = (0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5)
E2E_BUCKETS_S = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 300.0, 600.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)

REQUESTS_RUNNING = Gauge("ferry_requests_running", "Sequences in a worker's running batch.", ["role"])
REQUESTS_WAITING = Gauge(
    "ferry_requests_waiting", "Sequences queued in a worker's engine, not yet scheduled.", ["role"]
)
REQUESTS_FINISHED = Counter(
    "ferry_requests", "Finished requests by finish reason (stop, length, abort, error).", ["finish_reason"]
)
TIME_TO_FIRST_TOKEN = Histogram(
    "ferry_time_to_first_token_seconds", "Request accepted to first token sent.", buckets=TTFT_BUCKETS_S
)
INTER_TOKEN_LATENCY = Histogram(
    "ferry_inter_token_latency_seconds",
    "Gap between consecutive token events of one request.",
    buckets=ITL_BUCKETS_S,
)
E2E_REQUEST_LATENCY = Histogram(
    "ferry_e2e_request_latency_seconds", "Request accepted to finish sent.", buckets=E2E_BUCKETS_S
)
PROMPT_TOKENS = Counter("ferry_prompt_tokens", "Prompt tokens of accepted requests.")
GENERATION_TOKENS = Counter("ferry_generation_tokens", "Generated tokens streamed to clients.")
KV_CACHE_USAGE = Gauge("ferry_kv_cache_usage_ratio", "Used / total paged KV blocks of a worker (0..1).", ["role"])
PREFIX_CACHE_QUERIES = Counter("ferry_prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", ["role"])
PREFIX_CACHE_HITS = Counter("ferry_prefix_cache_hits", "Prompt tokens found in the prefix cache.", ["role"])
KV_STORE_LOOKUPS = Counter("ferry_kv_store_lookups", "Blocks asked for in KV store prefix lookups.")
KV_STORE_HITS = Counter("ferry_kv_store_hits", "Blocks found stored in the KV store.")
KV_STORE_USED_BYTES = Gauge("ferry_kv_store_used_bytes", "Memory the KV store's Redis uses (INFO used_memory).")
KV_STORE_MAX_BYTES = Gauge("ferry_kv_store_max_bytes", "The KV store's Redis maxmemory (0 = unlimited).")
KV_STORE_EVICTIONS = Counter("ferry_kv_store_evictions", "Blocks Redis evicted to stay under maxmemory.")
BATCH_SIZE = Histogram("ferry_batch_size", "Sequences in one engine step.", ["role"], buckets=BATCH_BUCKETS)
WORKER_QUEUE_DEPTH = Gauge(
    "ferry_worker_queue_depth", "Messages queued on a worker's JetStream consumer.", ["role", "worker"]
)
MIGRATIONS = Counter("ferry_migrations", "Requests resubmitted after losing their worker.", ["reason"])
ERRORS = Counter("ferry_errors", "Errors replied or logged, by service and kind.", ["service", "kind"])
BATCH_CAP = Gauge("ferry_batch_cap", "Running-sequence cap in force on a worker.", ["role"])
CHUNK_BUDGET = Gauge("ferry_chunk_budget_tokens", "Prefill tokens the next step may add.", ["role"])
STEP_MODEL = Gauge("ferry_step_model_ms", "A worker's learned step-time costs (ms).", ["role", "term"])
DESIRED_REPLICAS = Gauge(
    "ferry_desired_replicas", "Replicas of a role the traffic forecast needs within the SLO targets.", ["role"]
)
FORECAST_RPS = Gauge("ferry_forecast_requests_per_second", "Arrival rate now and forecast peak.", ["source", "kind"])
SLO_REQUESTS = Counter("ferry_slo_requests", "Finished requests by SLO outcome.", ["outcome"])
MODEL_INFO = Gauge(
    "ferry_model_info",
    "1 for the model a worker serves: name, architecture, weights dtype of its matmuls, the checkpoint's dtype.",
    ["role", "model", "arch", "weights_dtype", "checkpoint_dtype"],
)

ALL_METRICS = (
    REQUESTS_RUNNING,
    REQUESTS_WAITING,
    REQUESTS_FINISHED,
    TIME_TO_FIRST_TOKEN,
    INTER_TOKEN_LATENCY,
    E2E_REQUEST_LATENCY,
    PROMPT_TOKENS,
    GENERATION_TOKENS,
    KV_CACHE_USAGE,
    PREFIX_CACHE_QUERIES,
    PREFIX_CACHE_HITS,
    KV_STORE_LOOKUPS,
    KV_STORE_HITS,
    KV_STORE_USED_BYTES,
    KV_STORE_MAX_BYTES,
    KV_STORE_EVICTIONS,
    BATCH_SIZE,
    WORKER_QUEUE_DEPTH,
    MIGRATIONS,
    ERRORS,
    BATCH_CAP,
    CHUNK_BUDGET,
    STEP_MODEL,
    DESIRED_REPLICAS,
    FORECAST_RPS,
    SLO_REQUESTS,
    MODEL_INFO,
)
"""Every ferry metric object, for tests and for the dashboard check."""


def metric_names() -> list[str]:
    """Exposed base names (counters without their `_total` suffix, as prometheus_client keeps them)."""
    return [next(iter(m.describe())).name for m in ALL_METRICS]


def start_metrics_server(port: int, addr: str = "0.0.0.0") -> WSGIServer | None:
    """Serve /metrics on `port` in a daemon thread; 0 means metrics are off and returns None.

    Returns the server so a caller (or a test) can `shutdown()` it.
    """
    if not 0 <= port <= 65535:
        raise ValueError(f"metrics port={port!r} must be in 0..65535 (0 = off)")
    if port == 0:
        return None
    server, _thread = start_http_server(port, addr=addr, registry=REGISTRY)
    return server
