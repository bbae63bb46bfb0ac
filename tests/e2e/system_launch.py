"""Starting the whole system for end-to-end tests: `ferry up` as a subprocess, as a user would."""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from ferry.bench.compare.servers import ferry_up_argv
from ferry.launcher.servers import free_port
from ferry.launcher.up import ServiceSpec, add_arguments, plan_services

READY_TIMEOUT_S = 240.0
STATUS_LINE = re.compile(r"^\s+(\S+)\s+pid (\d+)\s")


def plan_up(argv: list[str], model_dir: Path, nats_url: str, redis_url: str) -> list[ServiceSpec]:
    """The processes `ferry up ARGV` would start (its own options and defaults, as a user would pass them),
    on these servers: for tests that spawn and kill the services one by one."""
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return plan_services(parser.parse_args(argv), model_dir, nats_url, redis_url)


@dataclass
class RunningSystem:
    process: subprocess.Popen
    base_url: str
    model_dir: Path
    model_name: str
    pids: dict[str, int] = field(default_factory=dict)
    """Service name -> pid, from the launcher's status lines."""
    output: list[str] = field(default_factory=list)

    def wait_for(self, text: str, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if any(text in line for line in self.output):
                return True
            if self.process.poll() is not None:
                time.sleep(0.2)  # let the reader thread catch the last lines
                return any(text in line for line in self.output)
            time.sleep(0.1)
        return False

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 60.0) -> int:
        if self.process.poll() is None:
            self.process.send_signal(sig)
        return self.process.wait(timeout=timeout_s)


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie is dead for our purposes (its parent has not reaped it yet)
    stat = Path(f"/proc/{pid}/stat")
    return not (stat.is_file() and stat.read_text().split(")")[-1].split()[0] == "Z")


def start_system(
    model_dir: Path,
    nats_url: str,
    redis_url: str,
    run_dir: Path,
    *,
    prefill: int = 0,
    decode: int = 0,
    both: int = 0,
    ep_size: int = 1,
    extra_env: dict[str, str] | None = None,
) -> RunningSystem:
    """`both` > 0: that many FERRY_ROLE=both workers (`--layout both`), else prefill + decode workers;
    `ep_size` > 1: each worker a group of that many ranks."""
    port = free_port()
    workers = ["--layout", "both", "--workers", str(both)] if both else []
    workers = workers or ["--prefill-workers", str(prefill), "--decode-workers", str(decode)]
    cmd = ferry_up_argv(model_dir, port, run_dir, *workers, "--nats-url", nats_url, "--redis-url", redis_url)
    cmd += ["--num-kv-blocks", "256", "--max-running", "16", "--ep-size", str(ep_size)]
    # XDG_CONFIG_HOME: the nats CLI context `ferry up` saves lands in the run dir, not in ~/.config
    env = {
        **os.environ,
        "FERRY_LOAD_INTERVAL_S": "0.25",
        "XDG_CONFIG_HOME": str(run_dir / "config"),
        **(extra_env or {}),
    }
    process = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    system = RunningSystem(process, f"http://127.0.0.1:{port}", model_dir, model_dir.name)
    threading.Thread(target=_read_output, args=(system,), daemon=True).start()
    if not system.wait_for("ferry up: ready", READY_TIMEOUT_S):
        system.stop(signal.SIGKILL)
        logs = "".join(f"\n--- {p.name}\n{p.read_text()[-1500:]}" for p in sorted(run_dir.glob("*.log")))
        raise RuntimeError("ferry up did not become ready:\n" + "\n".join(system.output) + logs)
    return system


def _read_output(system: RunningSystem) -> None:
    for line in system.process.stdout:
        line = line.rstrip("\n")
        system.output.append(line)
        match = STATUS_LINE.match(line)
        if match:
            system.pids[match.group(1)] = int(match.group(2))
