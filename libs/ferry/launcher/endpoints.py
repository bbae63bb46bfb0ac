"""Where `ferry up`'s servers run and how an operator reaches them: NATS on a known port with its
monitoring port, Redis, the URLs printed (without credentials) and a nats CLI context saved."""

from __future__ import annotations

import argparse
import contextlib
from pathlib import Path

from ferry.launcher.nats_context import save_context
from ferry.redact import redact_url

DEFAULT_NATS_PORT = 4222
DEFAULT_NATS_MONITOR_PORT = 8222


def start_servers(args: argparse.Namespace, stack: contextlib.ExitStack) -> tuple[str, str, str]:
    """NATS URL, its monitoring URL ('' when not started here) and Redis URL. Servers started here get
    args.support_nice, as the gateway and balancers do: under a burst their wake-ups wait for the workers'
    OpenMP threads instead of preempting one mid-step."""
    from ferry.launcher import servers

    nats_url, monitor_url, redis_url = args.nats_url, "", args.redis_url
    nice = getattr(args, "support_nice", 0) or 0
    if not nats_url:
        port = _port(args.nats_port, DEFAULT_NATS_PORT, "--nats-port")
        monitor_port = _port(args.nats_monitor_port, DEFAULT_NATS_MONITOR_PORT, "--nats-monitor-port")
        nats = stack.enter_context(servers.start_nats(port=port, monitor_port=monitor_port, nice=nice))
        nats_url, monitor_url = nats.url, nats.monitor_url
    if not redis_url:
        redis_url = stack.enter_context(servers.start_redis(nice=nice)).url
    return nats_url, monitor_url, redis_url


def _port(asked: int | None, default: int, flag: str) -> int:
    """The port asked for (which must be free), else the default when free, else any free one."""
    from ferry.launcher.servers import free_port, port_is_free

    if asked is not None:
        if not 1 <= asked <= 65535 or not port_is_free(asked):
            raise SystemExit(f"ferry up: {flag} {asked}: not a free port")
        return asked
    return default if port_is_free(default) else free_port()


def print_urls(args: argparse.Namespace, nats_url: str, monitor_url: str, redis_url: str, run_dir: Path) -> None:
    """Where everything is; URLs without their credentials. Saves the nats CLI context."""
    lines = [
        ("API", f"http://{args.host}:{args.port}/v1"),
        ("NATS", redact_url(nats_url)),
        ("NATS monitoring", monitor_url or "(not started by ferry up: see your NATS server)"),
        ("Redis", redact_url(redis_url)),
        ("logs", str(run_dir)),
    ]
    if args.nats_context:
        path = save_context(args.nats_context, nats_url, f"ferry up in {run_dir}")
        lines.append(("nats CLI", f"nats --context {args.nats_context} micro ls   (context saved in {path})"))
    for name, value in lines:
        print(f"ferry up: {name + ':':<17} {value}", flush=True)
