"""What `ferry up` starts: its command-line arguments, the layout they resolve to (split or both, worker
counts, threads, expert-parallel group sizes) and the plan of every process, without starting anything
(tests and the multi-turn bench plan with it too).
"""

from __future__ import annotations

import argparse
import os
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from ferry.dtypes import WEIGHTS_DTYPES
from ferry.launcher import SERVICE_MODULES
from ferry.launcher.endpoints import DEFAULT_NATS_MONITOR_PORT, DEFAULT_NATS_PORT
from ferry.model.source import DEFAULT_MODEL, DEMO_MODEL

SMALL_MACHINE_CORES = 4
"""Up to this many cores, `--layout auto` runs one worker that prefills and decodes: two model
processes would fight over the cores, and every sequence's KV would cross Redis for nothing."""
SUPPORT_NICE = 5
"""--support-nice default on small machines."""
GATEWAY_SCHED_BATCH_FROM = 4
"""Open streams from which a niced gateway's event loop runs SCHED_BATCH (ferry.sched)."""
STREAM_INTERVAL_MS = 50.0
"""--stream-interval-ms default on small machines: tokens of a stream sent together for up to this long."""
ONE_WORKER_WRITEBACK_DELAY_S = 5.0
"""--kv-writeback-delay-s default when one worker of layout both serves everything."""


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
    for role in ("prefill", "decode"):
        parser.add_argument(
            f"--{role}-ep-size",
            type=int,
            metavar="N",
            help=f"--layout split: the {role} workers' group size instead of --ep-size (decode may want wider "
            "groups than prefill, as the seed runs them)",
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
        help="niceness added to the gateway, balancers and kvcache (and the nats-server and redis-server that "
        "ferry up starts), so that on a busy CPU the workers' "
        "OpenMP teams are preempted less; with a niceness the gateway's event loop also runs SCHED_BATCH on Linux "
        "while $FERRY_SCHED_BATCH_FROM (4) or more streams are open (no wake-up preemption under a burst; 0: never) "
        f"(default {SUPPORT_NICE} on <= {SMALL_MACHINE_CORES} cores, else 0)",
    )
    parser.add_argument(
        "--stream-interval-ms",
        type=float,
        help="workers hold a stream's tokens up to this long and send them as one event (the first and last "
        "token at once), so the gateway and the client handle fewer, larger SSE events: CPU the model's cores "
        f"keep (default: FERRY_STREAM_INTERVAL_MS, else {STREAM_INTERVAL_MS:g} on <= {SMALL_MACHINE_CORES} "
        "cores, else 0 = every token at once)",
    )
    parser.add_argument(
        "--kv-writeback-delay-s",
        type=float,
        help="a finished sequence's KV is written to the store once the worker is idle or after this long "
        "(FERRY_KV_WRITEBACK_DELAY_S; 0 = at once). Default: FERRY_KV_WRITEBACK_DELAY_S, else "
        f"{ONE_WORKER_WRITEBACK_DELAY_S:g} with one worker of layout both (no other worker fetches a "
        "conversation's history from the store: the next turn finds it in this worker's pool), else 0",
    )
    parser.add_argument("--run-dir", type=Path, help="logs and the demo model (default: a new temp folder)")
    parser.add_argument("--ready-timeout", type=float, default=180.0, help="seconds to wait for readiness")


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
    if getattr(args, "stream_interval_ms", None) is None:
        from_env = os.environ.get("FERRY_STREAM_INTERVAL_MS")
        small = STREAM_INTERVAL_MS if num_cores <= SMALL_MACHINE_CORES else 0.0
        args.stream_interval_ms = float(from_env) if from_env else small
    if getattr(args, "kv_writeback_delay_s", None) is None:
        from_env = os.environ.get("FERRY_KV_WRITEBACK_DELAY_S")
        one_worker = ONE_WORKER_WRITEBACK_DELAY_S if args.layout == "both" and args.workers == 1 else 0.0
        args.kv_writeback_delay_s = float(from_env) if from_env else one_worker
    if args.torch_threads is None and os.environ.get("OMP_NUM_THREADS", "").isdigit():
        args.torch_threads = int(os.environ["OMP_NUM_THREADS"])  # the caller's choice, as before --torch-threads
    _resolve_ep_sizes(args)
    if args.torch_threads is None:  # every rank of every group is a process with its own threads
        if args.layout == "both":
            num_ranks = args.workers * args.ep_size
        else:
            num_ranks = args.prefill_workers * args.prefill_ep_size + args.decode_workers * args.decode_ep_size
        args.torch_threads = max(1, num_cores // num_ranks)


def _resolve_ep_sizes(args: argparse.Namespace) -> None:
    """--prefill-ep-size / --decode-ep-size default to --ep-size; they are for the split layout only."""
    args.ep_size = getattr(args, "ep_size", 1)
    asked = [f"--{r}-ep-size" for r in ("prefill", "decode") if getattr(args, f"{r}_ep_size", None) is not None]
    if asked and args.layout == "both":
        raise SystemExit(f"ferry up: {'/'.join(asked)} is for --layout split (both: --ep-size)")
    for role in ("prefill", "decode"):
        if getattr(args, f"{role}_ep_size", None) is None:
            setattr(args, f"{role}_ep_size", args.ep_size)
    if min(args.ep_size, args.prefill_ep_size, args.decode_ep_size) < 1:
        raise SystemExit("ferry up: --ep-size, --prefill-ep-size and --decode-ep-size must be >= 1")


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
            ("OMP_NUM_THREADS", args.torch_threads),
            ("FERRY_STREAM_INTERVAL_MS", getattr(args, "stream_interval_ms", None)),
            ("FERRY_KV_WRITEBACK_DELAY_S", getattr(args, "kv_writeback_delay_s", None)),
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
            role_ep_size = getattr(args, f"{role}_ep_size", None)  # both: none of its own
            ep_size: int = getattr(args, "ep_size", 1) if role_ep_size is None else role_ep_size
            if ep_size > 1:
                env["FERRY_EP_SIZE"] = str(ep_size)
            specs.append(ServiceSpec(f"worker-{role}-{i}", "worker", env, worker_id=worker_id))
    nice = getattr(args, "support_nice", 0) or 0
    for spec in specs:
        spec.nice = 0 if spec.worker_id else nice
    gateway_env = {
        **common,
        "FERRY_HTTP_HOST": args.host,
        "FERRY_HTTP_PORT": str(args.port),
        "FERRY_GATEWAY_ID": f"gateway-{tag}",
        # under a burst its wake-ups must not preempt the workers' OpenMP threads (ferry.sched)
        "FERRY_SCHED_BATCH_FROM": os.environ.get("FERRY_SCHED_BATCH_FROM", str(GATEWAY_SCHED_BATCH_FROM * bool(nice))),
    }
    specs.append(ServiceSpec("gateway", "gateway", gateway_env, nice=nice))
    return specs


def _available(kind: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(f"{SERVICE_MODULES[kind]}.__main__") is not None
