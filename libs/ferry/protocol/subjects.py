"""Every NATS subject, stream and queue-group name ferry uses, and their builders.

An operator reads a running system with these: `nats sub 'ferry.>'`, `nats stream info FERRY_WORK`,
`nats consumer info FERRY_WORK prefill-<worker>`, `nats micro ls`.
"""

from __future__ import annotations

from ferry.protocol.messages import ROLES, _is_token

PREFIX = "ferry"

SUBMIT = "ferry.submit"
"""gateway -> prefill-balancer, request/reply, queue group SUBMIT_QUEUE."""
HANDOFF = "ferry.handoff"
"""prefill worker -> decode-balancer, request/reply, queue group HANDOFF_QUEUE."""
CANCEL = "ferry.cancel"
"""gateway -> everyone, broadcast."""
LOAD_ALL = "ferry.load.>"
KV_EVENTS = "ferry.kv.events"
KV_LOOKUP = "ferry.kv.lookup"
KV_STATS = "ferry.kv.stats"
KV_PREFETCH_ALL = "ferry.kv.prefetch.>"
KV_WARM = "ferry.kv.warm"
"""decode worker -> prefill-balancer (queue group KV_WARM_QUEUE) and every decode-balancer: a finished
turn's chain (`KvWarm`)."""
KV_RESYNC = "ferry.kv.resync"
"""prefill-balancer -> prefill workers and kvcache, broadcast: republish what you hold (`KvResync`)."""
FORECAST_ALL = "ferry.forecast.>"
"""Every source's TrafficForecast."""

WORK_STREAM = "FERRY_WORK"
"""JetStream stream with work-queue retention over WORK_ALL."""
WORK_ALL = "ferry.work.>"

SUBMIT_QUEUE = "prefill-balancer"
HANDOFF_QUEUE = "decode-balancer"
KV_WARM_QUEUE = "prefill-balancer-warm"


def _token(name: str, what: str) -> str:
    if not _is_token(name):
        raise ValueError(f"{what}={name!r} must be letters, digits, '-' or '_'")
    return name


def _role(role: str) -> str:
    if role not in ROLES:
        raise ValueError(f"role={role!r} must be one of {ROLES}")
    return role


def work(role: str, worker_id: str) -> str:
    """JetStream subject holding `worker_id`'s queued work."""
    return f"ferry.work.{_role(role)}.{_token(worker_id, 'worker_id')}"


def work_role(role: str) -> str:
    """Wildcard for every worker's queued work of one role."""
    return f"ferry.work.{_role(role)}.*"


def work_consumer(role: str, worker_id: str) -> str:
    """Durable pull consumer name of a worker on WORK_STREAM."""
    return f"{_role(role)}-{_token(worker_id, 'worker_id')}"


def out(gateway_id: str) -> str:
    """Where workers publish token events for requests from `gateway_id`."""
    return f"ferry.out.{_token(gateway_id, 'gateway_id')}"


def kv_prefetch(worker_id: str) -> str:
    """prefill-balancer -> one worker: start fetching these blocks into your host tier (`KvPrefetch`)."""
    return f"ferry.kv.prefetch.{_token(worker_id, 'worker_id')}"


def load(role: str, worker_id: str) -> str:
    return f"ferry.load.{_role(role)}.{_token(worker_id, 'worker_id')}"


def load_role(role: str) -> str:
    """Wildcard for every worker's load reports of one role."""
    return f"ferry.load.{_role(role)}.*"


def forecast(source: str) -> str:
    """Where `source` publishes its TrafficForecast."""
    return f"ferry.forecast.{_token(source, 'source')}"
