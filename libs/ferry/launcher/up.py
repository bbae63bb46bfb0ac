"""`ferry up`: nats-server, redis-server and every ferry service as local processes, one command.

Uses NATS_URL / REDIS_URL (or --nats-url / --redis-url) when given, else starts the servers
itself. Every service is its own process (`python -m ferry_services.<module>`, configured by
FERRY_* variables) in its own process group, its output in `<run dir>/<service>.log`. Ctrl-C or
SIGTERM stops every service (SIGTERM to each group, SIGKILL after a grace period), then the
servers it started; if a service exits on its own, everything stops and the exit status is 1.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from ferry.launcher import SERVICE_MODULES
from ferry.launcher.endpoints import print_urls, start_servers
from ferry.launcher.up_plan import ServiceSpec, add_arguments, plan_services, resolve_layout
from ferry.model.source import DEMO_MODEL, model_problem, resolve_model

__all__ = ["add_arguments", "plan_services", "resolve_layout", "run", "spawn", "stop_children", "wait_ready"]

STOP_GRACE_S = 10.0
POLL_S = 0.2


class StopRequested(Exception):
    """SIGTERM or SIGINT arrived."""


@dataclass(slots=True)
class Child:
    spec: ServiceSpec
    process: subprocess.Popen
    log_path: Path

    def state(self) -> str:
        code = self.process.poll()
        return "running" if code is None else f"exited {code}"


def run(args: argparse.Namespace) -> int:
    resolve_layout(args)
    run_dir = args.run_dir or Path(tempfile.mkdtemp(prefix="ferry-up-"))
    run_dir.mkdir(parents=True, exist_ok=True)
    previous = {sig: signal.signal(sig, _raise_stop) for sig in (signal.SIGTERM, signal.SIGINT)}
    children: list[Child] = []
    try:
        with contextlib.ExitStack() as stack:
            nats_url, monitor_url, redis_url = start_servers(args, stack)
            stack.callback(stop_children, children)  # LIFO: registered after the servers, so it runs before they stop
            model_dir = _model(args.model, run_dir)
            specs = plan_services(args, model_dir, nats_url, redis_url)
            for spec in specs:  # appended one by one: a signal midway still stops those started
                children.append(spawn(spec, run_dir))
            print_urls(args, nats_url, monitor_url, redis_url, run_dir)
            print("ferry up: waiting for the workers to load the model; until 'ready' the API answers 503", flush=True)
            problem = wait_ready(children, f"http://{args.host}:{args.port}", args.ready_timeout)
            print_status(children, problem)
            return 1 if problem else supervise(children)
    except StopRequested:
        print("ferry up: stopping", flush=True)
        return 0
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _raise_stop(signum, frame) -> None:
    # Further signals during shutdown are ignored: stopping must run to the end.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    raise StopRequested(signum)


def _model(model: str, run_dir: Path) -> Path:
    if model != DEMO_MODEL:
        problem = model_problem(model)
        if problem:
            raise SystemExit(f"ferry up: --model {model}: {problem}")
        return resolve_model(model)
    from ferry.model.make_model import make_model

    path = make_model(run_dir / "demo-model", "llama", "tiny")
    print(
        f"ferry up: --model {DEMO_MODEL}: serving a tiny demo model at {path}; its weights are random, "
        "so its output is gibberish",
        flush=True,
    )
    return path


def spawn(spec: ServiceSpec, run_dir: Path) -> Child:
    """Start one service in its own process group, output to `<run_dir>/<name>.log`."""
    log_path = run_dir / f"{spec.name}.log"
    with open(log_path, "ab") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", SERVICE_MODULES[spec.kind]],
            env={**os.environ, **spec.env},
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own group: Ctrl-C reaches us only, and we stop it in order
            preexec_fn=functools.partial(_prepare_child, spec.nice) if sys.platform == "linux" else None,
        )
    return Child(spec, process, log_path)


def _prepare_child(nice: int) -> None:
    if nice:
        os.nice(nice)
    _die_with_parent()


def _die_with_parent() -> None:
    """Linux: the child gets SIGTERM if `ferry up` itself is killed (SIGKILL cannot be caught)."""
    import ctypes

    PR_SET_PDEATHSIG = 1
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def wait_ready(children: list[Child], base_url: str, timeout_s: float) -> str:
    """'' once the gateway's /ready lists every worker we started; else what went wrong."""
    import httpx

    worker_ids = {c.spec.worker_id for c in children if c.spec.worker_id}
    deadline = time.monotonic() + timeout_s
    with httpx.Client(timeout=2.0) as client:
        while time.monotonic() < deadline:
            dead = [c for c in children if c.process.poll() is not None]
            if dead:
                return f"{dead[0].spec.name} exited with {dead[0].process.returncode} (see {dead[0].log_path})"
            if worker_ids <= _ready_workers(client, base_url):
                return ""
            time.sleep(POLL_S)
    return f"not ready after {timeout_s:.0f}s (see the logs)"


def _ready_workers(client, base_url: str) -> set[str]:
    try:
        body = client.get(f"{base_url}/ready").json()
    except Exception:  # not listening yet, or not JSON yet
        return set()
    workers = body.get("workers", {}) if isinstance(body, dict) else {}
    return {w for ids in workers.values() for w in ids}


def print_status(children: list[Child], problem: str) -> None:
    for c in children:
        print(f"  {c.spec.name:<20} pid {c.process.pid:<8} {c.state():<10} {c.log_path}", flush=True)
    print(f"ferry up: {problem}" if problem else "ferry up: ready (Ctrl-C stops everything)", flush=True)


def supervise(children: list[Child]) -> int:
    """Until a signal (StopRequested) or until a service exits on its own (1)."""
    while True:
        for c in children:
            if c.process.poll() is not None:
                print(
                    f"ferry up: {c.spec.name} exited with {c.process.returncode} (see {c.log_path}); "
                    "stopping everything",
                    flush=True,
                )
                return 1
        time.sleep(POLL_S)


def stop_children(children: list[Child], grace_s: float = STOP_GRACE_S) -> None:
    """SIGTERM every process group, wait up to `grace_s`, then SIGKILL whatever is left in them."""
    for c in reversed(children):  # gateway first: no new requests while workers drain
        _signal_group(c, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for c in children:
        with contextlib.suppress(subprocess.TimeoutExpired):
            c.process.wait(timeout=max(0.0, deadline - time.monotonic()))
    for c in children:  # also reaches grandchildren left in the group by a service that exited
        _signal_group(c, signal.SIGKILL)
        c.process.wait()


def _signal_group(child: Child, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(child.process.pid, sig)
