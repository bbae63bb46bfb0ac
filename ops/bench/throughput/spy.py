"""Where the time goes in `ferry up` under the burst: py-spy on every process, the client included.

Starts `ferry up` (with --ferry-up-args), warms it up, then samples each service process and this
client process with `py-spy record --format raw` (wall-clock stacks of threads that are running,
--nonblocking) while the burst runs, and prints per process: samples (~ CPU seconds x rate) and the
functions with the most own samples; and every process's CPU seconds during the burst, and each thread's
(/proc). py-spy is a tool, not a dependency: give its path (without it, only the CPU seconds).
--engine first runs the in-process engine (`ferry.bench.throughput.inproc`) on the same burst, in its own
process, and prints its CPU seconds per thread too: what `ferry up` spends beyond its engine.

    python ops/bench/throughput/spy.py --py-spy /path/to/py-spy --model smollm2 --engine --out /tmp/prof
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
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
from ferry.bench.throughput.inproc import thread_cpu_delta, thread_cpu_s
from ferry.model.config import read_config
from ferry.model.source import resolve_model

STATUS = re.compile(r"^\s+(\S+)\s+pid (\d+)\s")
RATE_HZ = 200


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--py-spy", default="", help="py-spy binary; '' = only CPU seconds per process")
    p.add_argument("--model", required=True, help="checkpoint folder, .gguf file, or smollm2")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--ferry-up-args", default="", help="extra `ferry up` options")
    p.add_argument("--top", type=int, default=12)
    p.add_argument("--engine", action="store_true", help="the in-process engine on the same burst first")
    p.add_argument("--num-requests", type=int, default=None)
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    args.model = resolve_model(args.model)
    requests = burst.burst_requests(read_config(args.model).vocab_size, args.num_requests)
    if args.engine:
        print(engine_cpu(args.model, requests, args.out), flush=True)
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
        threads_before = {name: thread_cpu_s(pid) for name, pid in pids.items()}
        calls = [CompletionCall(r.index, ids_to_text(r.prompt_token_ids), r.max_tokens, 1) for r in requests]
        started = time.perf_counter()
        phase = asyncio.run(run_phase(calls, [0.0] * len(calls), config, "burst", math.inf))
        wall = time.perf_counter() - started
        cpu = {_name(p, pids): _cpu_s(p) - cpu_before[p.pid] for p in processes}
        threads = {name: thread_cpu_delta(threads_before[name], thread_cpu_s(pid)) for name, pid in pids.items()}
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
        text = ", ".join(f"{_thread_label(key, pids[name])} {s:.2f}" for key, s in rows.items() if s >= 0.01)
        print(f"{name} CPU seconds per thread: {text}")
    doc = {"wall_s": wall, "tokens": tokens, "cpu_s": cpu, "thread_cpu_s": threads}
    (args.out / "cpu.json").write_text(json.dumps(doc, indent=1))
    for name in pids if args.py_spy else ():
        print(summarize(name, args.out / f"{name}.txt", args.top))
    return 0


def _cpu_s(process) -> float:
    try:
        times = process.cpu_times()
    except psutil.NoSuchProcess:
        return 0.0
    return times.user + times.system


def _thread_label(key: str, pid: int) -> str:
    tid, _, name = key.partition(":")
    return "main" if int(tid) == pid else f"{tid}({name})"


def engine_cpu(model: Path, requests: list, out: Path) -> str:
    """The in-process engine on `requests` in its own process: tok/s and CPU seconds per thread (main: the
    thread that steps it; the others are its OpenMP team and torch's helpers)."""
    prompts = burst.write_prompts(requests, out / "burst.jsonl")
    argv = [sys.executable, "-m", "ferry.bench.throughput.inproc", "--model", str(model), "--prompts", str(prompts)]
    done = subprocess.run(argv, capture_output=True, text=True, check=True)
    fig = json.loads(done.stdout.strip().splitlines()[-1])
    (out / "engine.json").write_text(json.dumps(fig, indent=1))
    threads = ", ".join(f"{key.partition(':')[0]} {s:.2f}" for key, s in fig["thread_cpu_s"].items() if s >= 0.01)
    return (
        f"engine in-process: {fig['output_tokens']} tokens in {fig['wall_s']:.2f} s = "
        f"{fig['output_tokens_per_s']:.0f} tok/s; CPU {fig['cpu_s']:.2f} s; per thread: {threads}"
    )


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
    inclusive: collections.Counter[str] = collections.Counter()
    total = 0
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not count.isdigit():
            continue
        total += int(count)
        frames = stack.split(";")
        own[frames[-1]] += int(count)
        for frame in set(frames):
            inclusive[frame] += int(count)
    rows = [f"  {n / max(total, 1):6.1%}  {frame[:150]}" for frame, n in own.most_common(top)]
    under = [f"  {n / max(total, 1):6.1%}  {frame[:150]}" for frame, n in inclusive.most_common(3 * top)]
    head = f"\n## {name}: {total} samples ({total / RATE_HZ:.1f} thread-s)\n"
    return head + "\n".join(rows) + "\n  -- inclusive (the frame anywhere on the stack):\n" + "\n".join(under)


if __name__ == "__main__":
    sys.exit(main())
