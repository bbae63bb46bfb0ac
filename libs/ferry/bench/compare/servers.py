"""Start and stop the HTTP systems under comparison as child processes, one at a time.

Each server runs in its own process group with its output in `<run dir>/<name>.log`, and is
stopped with SIGTERM to its own process, then SIGKILL to the group, so `ferry up`'s nats-server,
redis-server and services all go with it.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

STOP_GRACE_S = 15.0


@dataclass(slots=True)
class ServerProcess:
    name: str
    base_url: str
    process: subprocess.Popen
    log_path: Path

    def log_tail(self, num_lines: int = 15) -> str:
        lines = self.log_path.read_text(errors="replace").splitlines() if self.log_path.exists() else []
        return "\n".join(lines[-num_lines:])


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def spawn(name: str, argv: list[str], base_url: str, run_dir: Path, env: dict[str, str] | None = None) -> ServerProcess:
    log_path = run_dir / f"{name}.log"
    with open(log_path, "wb") as log:  # fresh: a ready marker from an earlier run must not count
        process = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **(env or {})},
            start_new_session=True,
        )
    return ServerProcess(name, base_url, process, log_path)


def parse_systems(text: str, allowed: tuple[str, ...]) -> list[str]:
    """A `--systems a,b` option: the names in order, each one of `allowed`, at least one."""
    chosen = [s.strip() for s in text.split(",") if s.strip()]
    if not chosen or set(chosen) - set(allowed):
        raise SystemExit(f"--systems: choose from {allowed}")
    return chosen


def ferry_up_argv(model: str | Path, port: int, run_dir: Path, *extra_args: str) -> list[str]:
    """The `ferry up` command line every harness and system test starts: this interpreter's ferry."""
    argv = [sys.executable, "-m", "ferry.cli", "up", "--model", str(model), "--port", str(port)]
    return [*argv, "--run-dir", str(run_dir), *extra_args]


def start_ferry_up(model_dir: Path, run_dir: Path, extra_args: list[str]) -> ServerProcess:
    """`ferry up` on a free port: its own nats-server, redis-server, balancers, workers, gateway."""
    port = free_port()
    argv = ferry_up_argv(model_dir, port, run_dir / "ferry-up-run", *extra_args)
    return spawn("ferry-up", argv, f"http://127.0.0.1:{port}", run_dir)


def start_hf_serve(model_dir: Path, run_dir: Path, extra_args: list[str]) -> ServerProcess:
    """`transformers serve <folder> --continuous-batching` on CPU, offline (no Hub access)."""
    port = free_port()
    exe = Path(sys.executable).parent / "transformers"
    argv = [
        str(exe),
        "serve",
        str(model_dir),
        "--continuous-batching",
        "--device",
        "cpu",
        "--dtype",
        "float32",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        *extra_args,
    ]
    env = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    return spawn("hf-serve", argv, f"http://127.0.0.1:{port}", run_dir, env)


def wait_ready(
    server: ServerProcess, timeout_s: float, log_marker: str | None = None, health_path: str = "/health"
) -> str:
    """'' once the server is ready (its log shows `log_marker`, else `health_path` answers 200);
    otherwise what went wrong, with the end of its log."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            return f"{server.name} exited with {server.process.returncode}:\n{server.log_tail()}"
        if _is_ready(server, log_marker, health_path):
            return ""
        time.sleep(0.5)
    return f"{server.name} not ready after {timeout_s:.0f}s:\n{server.log_tail()}"


def _is_ready(server: ServerProcess, log_marker: str | None, health_path: str) -> bool:
    if log_marker is not None:
        return server.log_path.exists() and log_marker in server.log_path.read_text(errors="replace")
    try:
        return httpx.get(server.base_url + health_path, timeout=2.0).status_code == 200
    except httpx.HTTPError:
        return False


def stop(server: ServerProcess, grace_s: float = STOP_GRACE_S) -> None:
    """SIGTERM the server's own process, SIGKILL its whole process group after it exits or after
    `grace_s`. Only the leader gets SIGTERM: `ferry up` stops its services before its nats-server
    and redis-server, which a group-wide SIGTERM would kill under them."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        server.process.send_signal(signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        server.process.wait(timeout=grace_s)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(server.process.pid, signal.SIGKILL)
    server.process.wait()
