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
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from ferry.dtypes import WEIGHTS_DTYPES
from ferry.launcher import SERVICE_MODULES
from ferry.launcher.endpoints import DEFAULT_NATS_MONITOR_PORT, DEFAULT_NATS_PORT, print_urls, start_servers
from ferry.model.source import DEFAULT_MODEL, DEMO_MODEL, model_problem, resolve_model

STOP_GRACE_S = 10.0
SMALL_MACHINE_CORES = 4
"""Up to this many cores, `--layout auto` runs one worker that prefills and decodes: two model
processes would fight over the cores, and every sequence's KV would cross Redis for nothing."""
SUPPORT_NICE = 5
"""--support-nice default on small machines."""
POLL_S = 0.2


class StopRequested(Exception):
    """SIGTERM or SIGINT arrived."""


@dataclass(slots=True)
class ServiceSpec:
    name: str
    """Shown in status lines and names the log file: 'gateway', 'worker-prefill-0', ..."""
    kind: str
    """A key of SERVICE_MODULES."""
    env: dict[str, str] = field(default_factory=dict)
    """FERRY_* variables on top of this process's environment."""
    worker_id: str = ""
    nice: int = 0
    """Added to the process's niceness: the gateway, balancers and kvcache yield the cores to workers."""


@dataclass(slots=True)
class Child:
    spec: ServiceSpec
    process: subprocess.Popen
    log_path: Path

    def state(self) -> str:
        code = self.process.poll()
        return "running" if code is None else f"exited {code}"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model",
        default=DEFAULT_MODEL,
        help=f"checkpoint folder, .gguf file, {DEFAULT_MODEL} (SmolLM2-135M-Instruct, the default) "
        f"or {DEMO_MODEL} (a tiny random-weight model)",
    )
    parser.add_argument(
        "--layout",
        choices=("auto", "split", "both"),
        default="auto",
        help="split: prefill and decode workers (KV handed over through Redis); both: workers that "
        f"prefill and decode (FERRY_ROLE=both, no hand-off); auto: both on a machine of <= {SMALL_MACHINE_CORES} "
        "cores unless --prefill-workers/--decode-workers are given, else split",
    )
    parser.add_argument("--workers", type=int, default=1, metavar="K", help="worker processes of layout both (1)")
    parser.add_argument(
        "--prefill-workers", type=int, metavar="N", help="prefill worker processes of layout split (default 1)"
    )
    parser.add_argument(
        "--decode-workers", type=int, metavar="M", help="decode worker processes of layout split (default 1)"
    )
    parser.add_argument("--host", default="127.0.0.1", help="gateway HTTP host")
    parser.add_argument("--port", type=int, default=8000, help="gateway HTTP port")
    parser.add_argument(
        "--nats-url",
        default=os.environ.get("NATS_URL", ""),
        help="use this NATS (default $NATS_URL; none: start nats-server)",
    )
    parser.add_argument(
        "--nats-port",
        type=int,
        help=f"port of the nats-server started here (default {DEFAULT_NATS_PORT}, a free one if taken)",
    )
    parser.add_argument(
        "--nats-monitor-port",
        type=int,
        help=f"its HTTP monitoring port (default {DEFAULT_NATS_MONITOR_PORT}, a free one if taken)",
    )
    parser.add_argument(
        "--nats-context",
        default="ferry-up",
        metavar="NAME",
        help="save a nats CLI context of this name for the NATS in use ('' = none)",
    )
    parser.add_argument(
        "--redis-url",
        default=os.environ.get("REDIS_URL", ""),
        help="use this Redis (default $REDIS_URL; none: start redis-server)",
    )
    parser.add_argument(
        "--weights-dtype",
        choices=WEIGHTS_DTYPES,
        help="how workers hold projection weights (FERRY_WEIGHTS_DTYPE; default auto: the checkpoint's)",
    )
    parser.add_argument("--num-kv-blocks", type=int, help="KV blocks per worker (FERRY_NUM_KV_BLOCKS)")
    parser.add_argument("--max-running", type=int, help="batch cap per worker (FERRY_MAX_RUNNING)")
    parser.add_argument("--max-batch-tokens", type=int, help="tokens per step (FERRY_MAX_BATCH_TOKENS)")
    parser.add_argument(
        "--ep-size",
        type=int,
        default=1,
        metavar="N",
        help="expert parallelism: every worker is a group of N rank processes holding one MoE model "
        "(FERRY_EP_SIZE; N must divide the routed experts)",
    )
    parser.add_argument(
        "--torch-threads",
        type=int,
        help="CPU threads per worker; default: $OMP_NUM_THREADS if set, else the cores shared out among "
        "the workers (at least 1 each), so their threads never outnumber the cores",
    )
    parser.add_argument(
        "--support-nice",
        type=int,
        help="niceness added to the gateway, balancers and kvcache, so that on a busy CPU the workers' "
        f"OpenMP teams are preempted less (default {SUPPORT_NICE} on <= {SMALL_MACHINE_CORES} cores, else 0)",
    )
    parser.add_argument("--run-dir", type=Path, help="logs and the demo model (default: a new temp folder)")
    parser.add_argument("--ready-timeout", type=float, default=180.0, help="seconds to wait for readiness")


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


def resolve_layout(args: argparse.Namespace, num_cores: int | None = None) -> None:
    """Fix `args.layout` (auto -> split or both), the worker counts and `args.torch_threads`."""
    num_cores = num_cores or os.cpu_count() or 1
    split_asked = args.prefill_workers is not None or args.decode_workers is not None
    if args.layout == "auto":
        args.layout = "split" if split_asked or num_cores > SMALL_MACHINE_CORES else "both"
    if args.layout == "both" and split_asked:
        raise SystemExit("ferry up: --prefill-workers/--decode-workers are for --layout split (both: --workers)")
    args.prefill_workers = 1 if args.prefill_workers is None else args.prefill_workers
    args.decode_workers = 1 if args.decode_workers is None else args.decode_workers
    if min(args.prefill_workers, args.decode_workers, args.workers) < 1:
        raise SystemExit("ferry up: --workers, --prefill-workers and --decode-workers must be >= 1")
    if getattr(args, "support_nice", None) is None:
        args.support_nice = SUPPORT_NICE if num_cores <= SMALL_MACHINE_CORES else 0
    if args.torch_threads is None and os.environ.get("OMP_NUM_THREADS", "").isdigit():
        args.torch_threads = int(os.environ["OMP_NUM_THREADS"])  # the caller's choice, as before --torch-threads
    if args.torch_threads is None:
        num_workers = args.workers if args.layout == "both" else args.prefill_workers + args.decode_workers
        args.torch_threads = max(1, num_cores // (num_workers * getattr(args, "ep_size", 1)))


def plan_services(args: argparse.Namespace, model_dir: Path, nats_url: str, redis_url: str) -> list[ServiceSpec]:
    """Every process `ferry up` starts, in start order."""
    if getattr(args, "layout", "split") == "auto":
        resolve_layout(args)
    common = {"FERRY_NATS_URL": nats_url, "FERRY_REDIS_URL": redis_url, "FERRY_MODEL": str(model_dir)}
    common["OMP_NUM_THREADS"] = "1"  # no model in them: their torch import must not spin threads on the cores
    tag = uuid.uuid4().hex[:4]  # two `ferry up` on one NATS must not share worker ids
    worker_env = {
        k: str(v)
        for k, v in (
            ("FERRY_WEIGHTS_DTYPE", args.weights_dtype),
            ("FERRY_NUM_KV_BLOCKS", args.num_kv_blocks),
            ("FERRY_MAX_RUNNING", args.max_running),
            ("FERRY_MAX_BATCH_TOKENS", args.max_batch_tokens),
            ("FERRY_EP_SIZE", getattr(args, "ep_size", 1) if getattr(args, "ep_size", 1) > 1 else None),
            ("OMP_NUM_THREADS", args.torch_threads),
        )
        if v is not None
    }
    specs = []
    if _available("kvcache"):
        specs.append(ServiceSpec("kvcache", "kvcache", dict(common)))
    specs += [
        ServiceSpec("prefill-balancer", "prefill-balancer", dict(common)),
        ServiceSpec("decode-balancer", "decode-balancer", dict(common)),
    ]
    roles = [("both", args.workers)] if getattr(args, "layout", "split") == "both" else []
    roles = roles or [("prefill", args.prefill_workers), ("decode", args.decode_workers)]
    for role, count in roles:
        for i in range(count):
            worker_id = f"{role}-{i}-{tag}"
            env = {**common, **worker_env, "FERRY_ROLE": role, "FERRY_WORKER_ID": worker_id}
            specs.append(ServiceSpec(f"worker-{role}-{i}", "worker", env, worker_id=worker_id))
    nice = getattr(args, "support_nice", 0) or 0
    for spec in specs:
        spec.nice = 0 if spec.worker_id else nice
    gateway_env = {
        **common,
        "FERRY_HTTP_HOST": args.host,
        "FERRY_HTTP_PORT": str(args.port),
        "FERRY_GATEWAY_ID": f"gateway-{tag}",
    }
    specs.append(ServiceSpec("gateway", "gateway", gateway_env, nice=nice))
    return specs


def _available(kind: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(f"{SERVICE_MODULES[kind]}.__main__") is not None


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
