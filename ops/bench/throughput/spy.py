"""Where the time goes in `ferry up` under the burst: py-spy on every process, the client included.

Starts `ferry up` (with --ferry-up-args), warms it up, then samples each service process and this
client process with `py-spy record --format raw` (wall-clock stacks of threads that are running,
--nonblocking) while the burst runs, and prints per process: samples (~ CPU seconds x rate) and the
functions with the most own samples; and every process's CPU seconds during the burst (psutil).
py-spy is a tool, not a dependency: give its path (without it, only the CPU seconds).

    python ops/bench/throughput/spy.py --py-spy /path/to/py-spy --model DIR --out /tmp/prof
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import math
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

from ferry.bench.compare import servers
from ferry.bench.http_client import CompletionCall
from ferry.bench.online import OnlineConfig, detect_model, ids_to_text, run_phase
from ferry.bench.throughput import burst

STATUS = re.compile(r"^\s+(\S+)\s+pid (\d+)\s")
RATE_HZ = 200


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--py-spy", default="", help="py-spy binary; '' = only CPU seconds per process")
    p.add_argument("--model", type=Path, required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--ferry-up-args", default="", help="extra `ferry up` options")
    p.add_argument("--top", type=int, default=12)
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    vocab = int(__import__("json").loads((args.model / "config.json").read_text())["vocab_size"])
    requests = burst.burst_requests(vocab)
    server = servers.start_ferry_up(args.model, args.out, args.ferry_up_args.split())
    try:
        problem = servers.wait_ready(server, 300, log_marker="ferry up: ready")
        if problem:
            raise SystemExit(problem)
        pids = {m.group(1): int(m.group(2)) for m in map(STATUS.match, server.log_path.read_text().splitlines()) if m}
        pids["client"] = os.getpid()
        config = OnlineConfig(
            base_url=server.base_url, model=detect_model(server.base_url), length_control="none", show_progress=False
        )
        warm = [CompletionCall(i, "the ferry river boat harbor dock", 4, 7) for i in range(2)]
        asyncio.run(run_phase(warm, [0.0, 0.0], config, "warm-up", math.inf))
        spies = {name: _spy(args.py_spy, pid, args.out / f"{name}.txt") for name, pid in pids.items() if args.py_spy}
        time.sleep(1.0)  # py-spy attached
        processes = [psutil.Process(), *psutil.Process(server.process.pid).children(recursive=True)]
        cpu_before = {p.pid: _cpu_s(p) for p in processes}
        workers = {name: pid for name, pid in pids.items() if name.startswith("worker")}
        threads_before = {name: _thread_cpu_s(pid) for name, pid in workers.items()}
        calls = [CompletionCall(r.index, ids_to_text(r.prompt_token_ids), r.max_tokens, 1) for r in requests]
        started = time.perf_counter()
        phase = asyncio.run(run_phase(calls, [0.0] * len(calls), config, "burst", math.inf))
        wall = time.perf_counter() - started
        cpu = {_name(p, pids): _cpu_s(p) - cpu_before[p.pid] for p in processes}
        threads = {name: _thread_delta(threads_before[name], _thread_cpu_s(pid)) for name, pid in workers.items()}
        for spy in spies.values():
            spy.send_signal(signal.SIGINT)  # py-spy writes its output on SIGINT
        for spy in spies.values():
            spy.wait(timeout=30)
    finally:
        servers.stop(server)
    tokens = sum(r.num_output_tokens for r in phase.results if r.ok)
    spied = f"py-spy at {RATE_HZ} Hz" if args.py_spy else "no py-spy"
    print(f"burst: {tokens} tokens in {wall:.2f} s = {tokens / wall:.0f} tok/s ({spied})")
    print(
        "CPU seconds during the burst: "
        + ", ".join(f"{k} {v:.2f}" for k, v in sorted(cpu.items(), key=lambda kv: -kv[1]))
    )
    for name, rows in threads.items():  # the asyncio thread is the main one (tid = pid)
        pid = pids[name]
        text = ", ".join(f"{'main' if tid == pid else tid} {s:.2f}" for tid, s in rows if s >= 0.01)
        print(f"{name} CPU seconds per thread: {text}")
    for name in pids if args.py_spy else ():
        print(summarize(name, args.out / f"{name}.txt", args.top))
    return 0


def _cpu_s(process) -> float:
    try:
        times = process.cpu_times()
    except psutil.NoSuchProcess:
        return 0.0
    return times.user + times.system


def _thread_cpu_s(pid: int) -> dict[int, float]:
    try:
        return {t.id: t.user_time + t.system_time for t in psutil.Process(pid).threads()}
    except psutil.NoSuchProcess:
        return {}


def _thread_delta(before: dict[int, float], after: dict[int, float]) -> list[tuple[int, float]]:
    """CPU seconds per thread between the two snapshots, most first."""
    return sorted(((tid, s - before.get(tid, 0.0)) for tid, s in after.items()), key=lambda kv: -kv[1])


def _name(process, pids: dict[str, int]) -> str:
    by_pid = {pid: name for name, pid in pids.items()}
    if process.pid in by_pid:
        return by_pid[process.pid]
    try:
        return f"{process.name()}-{process.pid}"
    except psutil.NoSuchProcess:
        return str(process.pid)


def _spy(py_spy: str, pid: int, out: Path) -> subprocess.Popen:
    argv = [py_spy, "record", "--pid", str(pid), "--rate", str(RATE_HZ), "--format", "raw", "--nonblocking"]
    return subprocess.Popen([*argv, "--output", str(out)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def summarize(name: str, path: Path, top: int) -> str:
    """Samples in this process and the functions with the most own (leaf) samples."""
    if not path.exists():
        return f"\n## {name}: no profile"
    own: collections.Counter[str] = collections.Counter()
    total = 0
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not count.isdigit():
            continue
        total += int(count)
        own[stack.split(";")[-1]] += int(count)
    rows = [f"  {n / max(total, 1):6.1%}  {frame[:150]}" for frame, n in own.most_common(top)]
    return f"\n## {name}: {total} samples ({total / RATE_HZ:.1f} thread-s)\n" + "\n".join(rows)


if __name__ == "__main__":
    sys.exit(main())
