"""Starting ferry without Docker: `ferry up` (everything as local processes), `ferry serve` (one
service in this process), and local nats-server/redis-server (`ferry.launcher.servers`)."""

SERVICE_MODULES: dict[str, str] = {
    "gateway": "ferry_services.gateway",
    "prefill-balancer": "ferry_services.prefill_balancer",
    "decode-balancer": "ferry_services.decode_balancer",
    "worker": "ferry_services.worker",
    "kvcache": "ferry_services.kvcache",
}
"""Service name (as `ferry serve` takes it) -> the module `python -m` runs."""
