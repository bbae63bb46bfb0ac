"""The in-process engine on the burst: `LLMEngine` in this process, every request added at t=0,
stepped until done (detokenizing, as a server does); prints one JSON line of figures.

    python ops/bench/throughput/inproc.py --model DIR --prompts burst.jsonl [--threads N]

Run as its own process by run.py, so its torch threads are its own."""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

from ferry.bench.throughput import burst


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", type=Path, required=True)
    p.add_argument("--prompts", type=Path, required=True)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch's default)")
    p.add_argument("--max-num-seqs", type=int, default=64)
    args = p.parse_args()
    import torch

    from ferry.bench.offline_report import model_flops_per_token
    from ferry.engine import EngineConfig, LLMEngine
    from ferry.engine.config import WORKER_HOST_KV_BLOCKS, WORKER_NUM_KV_BLOCKS
    from ferry.protocol import SamplingParams

    if args.threads:
        torch.set_num_threads(args.threads)
    requests = burst.read_prompts(args.prompts)
    config = EngineConfig(  # the KV pool and host tier `ferry up`'s worker gets, so both sides hold the same
        max_num_seqs=args.max_num_seqs, num_kv_blocks=WORKER_NUM_KV_BLOCKS, host_cache_blocks=WORKER_HOST_KV_BLOCKS
    )
    engine = LLMEngine.from_model_path(str(args.model), config)
    warm = SamplingParams(max_tokens=4, temperature=0.0)
    engine.add_request("warm", requests[0].prompt_token_ids[:16], warm)
    while engine.has_unfinished_requests():
        engine.step()
    cpu_before = thread_cpu_s()
    start = time.perf_counter()
    for r in requests:
        engine.add_request(str(r.index), r.prompt_token_ids, SamplingParams(max_tokens=r.max_tokens, temperature=0.0))
    first: dict[str, float] = {}
    outputs = {str(r.index): 0 for r in requests}
    while engine.has_unfinished_requests():
        for out in engine.step():
            first.setdefault(out.request_id, time.perf_counter() - start)
            outputs[out.request_id] += len(out.new_token_ids)
    wall = time.perf_counter() - start
    threads = thread_cpu_delta(cpu_before, thread_cpu_s())
    num_in = sum(len(r.prompt_token_ids) for r in requests)
    attention = burst.attention_flops(
        engine.lm.config, [(len(r.prompt_token_ids), outputs[str(r.index)]) for r in requests]
    )
    num_out = sum(outputs.values())
    row = burst.figures(wall, num_out, num_in, list(first.values()), model_flops_per_token(engine.lm), attention)
    row["threads"] = torch.get_num_threads()
    row["mean_batch_size"] = engine.stats().mean_batch_size
    row["cpu_s"] = sum(threads.values())
    row["thread_cpu_s"] = {name: round(s, 3) for name, s in threads.items() if s >= 0.005}
    print(json.dumps(row))


def thread_cpu_s(pid: int | str = "self") -> dict[str, float]:
    """CPU seconds (user + system) of each thread of a process so far, keyed 'tid:name' (/proc, Linux)."""
    ticks = os.sysconf("SC_CLK_TCK")
    out = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            stat = (task / "stat").read_text()
        except OSError:  # the thread ended
            continue
        name, fields = stat[stat.index("(") + 1 : stat.rindex(")")], stat[stat.rindex(")") + 2 :].split()
        out[f"{task.name}:{name}"] = (int(fields[11]) + int(fields[12])) / ticks  # utime, stime
    return out


def thread_cpu_delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """CPU seconds per thread between two `thread_cpu_s` snapshots, most first."""
    rows = ((key, s - before.get(key, 0.0)) for key, s in after.items())
    return dict(sorted(rows, key=lambda kv: -kv[1]))


if __name__ == "__main__":
    main()
