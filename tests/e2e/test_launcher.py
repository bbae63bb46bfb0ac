"""`ferry up` on its own: it starts nats-server and redis-server itself when given no URLs, and
Ctrl-C (SIGINT) stops every process it started, servers included, the servers last."""

from __future__ import annotations

import signal
import subprocess

import pytest
from system_launch import pid_alive, start_system

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def descendants(pid: int) -> set[int]:
    """Every process below `pid` (children, grandchildren, ...)."""
    out = subprocess.run(["ps", "-e", "-o", "pid=,ppid="], capture_output=True, text=True, check=True).stdout
    children: dict[int, list[int]] = {}
    for line in out.splitlines():
        child, parent = map(int, line.split())
        children.setdefault(parent, []).append(child)
    found, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.add(child)
            todo.append(child)
    return found


def command(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except OSError:  # already gone
        return ""


def test_ctrl_c_stops_every_service_and_the_servers_it_started(e2e_model, tmp_path, monkeypatch):
    monkeypatch.delenv("NATS_URL", raising=False)
    monkeypatch.delenv("REDIS_URL", raising=False)
    system = start_system(e2e_model, "", "", tmp_path, prefill=1, decode=1)
    try:
        started = descendants(system.process.pid)
        names = set(system.pids)
        commands = {command(p) for p in started}
    finally:
        exit_code = system.stop(signal.SIGINT)
    assert exit_code == 0
    assert {"prefill-balancer", "decode-balancer", "worker-prefill-0", "worker-decode-0", "gateway"} <= names
    assert {"nats-server", "redis-server"} <= commands
    assert [p for p in started if pid_alive(p)] == []
    assert "ferry up: stopping" in system.output
    # the API address comes with a word that workers are still loading; 'ready' follows once they report
    printed = "\n".join(system.output)
    assert printed.index("until 'ready' the API answers 503") < printed.index("ferry up: ready")
    # the services stop while their servers still run: no service lost its bus or store on the way out
    for log in tmp_path.glob("*.log"):
        text = log.read_text()
        assert "NATS drain failed" not in text and "kvcache DEGRADED" not in text, f"{log.name}: {text[-2000:]}"
