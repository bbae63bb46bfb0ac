"""gloo's threads of a CPU rank: where they may run and how much CPU they take.

On gloo an async all-to-all is carried by threads of the rank process: a ProcessGroupGloo worker
(`pt_gloo_runloop`) runs the collective, and the TCP transport's event loop (`gloo_tcp_loop`) moves
the bytes when a socket is ready, copying them through the kernel's loopback sockets. While the
other micro-batch computes, that CPU work takes a core from some rank's compute thread: on a CPU
whose cores the ranks' compute already fills, an overlapped transfer is not free
(ferry.bench.ep_overlap_stats counts what it costs the compute).
"""

from __future__ import annotations

import os
from pathlib import Path

GLOO_THREAD_NAMES = ("pt_gloo_runloop", "gloo_tcp_loop")


def threads() -> dict[int, str]:
    """{thread id: name} of every thread of this process (Linux /proc)."""
    tasks = Path("/proc/self/task")
    return {int(task.name): (task / "comm").read_text().strip() for task in sorted(tasks.iterdir())}


def thread_cores() -> dict[str, str]:
    """{"name/tid": the cores it may run on}, every thread of this process."""
    out = {}
    for tid, name in threads().items():
        status = (Path("/proc/self/task") / str(tid) / "status").read_text()
        allowed = next(
            (line.split(":", 1)[1].strip() for line in status.splitlines() if line.startswith("Cpus_allowed_list")), "?"
        )
        out[f"{name}/{tid}"] = f"cores {allowed}, nice {os.getpriority(os.PRIO_PROCESS, tid)}"
    return out


def gloo_threads() -> list[int]:
    """Thread ids of this process's gloo threads (after the group started, which creates them)."""
    return [tid for tid, name in threads().items() if name.startswith(GLOO_THREAD_NAMES)]


def cpu_seconds(tids: list[int]) -> float:
    """CPU time the threads have run so far, in seconds (Linux schedstat: nanoseconds on a CPU)."""
    tasks = Path("/proc/self/task")
    return sum(int((tasks / str(tid) / "schedstat").read_text().split()[0]) for tid in tids) / 1e9
