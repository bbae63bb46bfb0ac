"""The burst workload as files and calls every system of this harness reads, and the figures they share.

One seeded `ferry.bench.workload.BURST` workload: token-id prompts (JSONL for the offline processes,
one word per id for the HTTP servers), greedy, each request's own max_tokens, no ignore_eos.
"""

from __future__ import annotations

import json
from pathlib import Path

from ferry.bench.workload import WorkloadRequest, latency_summary, make_workload, named_workload


def burst_requests(vocab_size: int, num_requests: int | None = None, seed: int = 0) -> list[WorkloadRequest]:
    extra = {"num_requests": num_requests} if num_requests else {}
    return make_workload(named_workload("burst", vocab_size=vocab_size, seed=seed, **extra))


def write_prompts(requests: list[WorkloadRequest], path: Path) -> Path:
    """`ferry generate --prompts-file` JSONL: token ids and each request's max_tokens."""
    lines = [json.dumps({"prompt_token_ids": r.prompt_token_ids, "max_tokens": r.max_tokens}) for r in requests]
    path.write_text("\n".join(lines) + "\n")
    return path


def read_prompts(path: Path) -> list[WorkloadRequest]:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [WorkloadRequest(i, row["prompt_token_ids"], row["max_tokens"]) for i, row in enumerate(rows)]


def figures(wall_s: float, output_tokens: int, prompt_tokens: int, ttft_s: list[float], flops_per_token: float) -> dict:
    """The figures every system reports: throughput over `wall_s`, TTFT, model FLOPs delivered.

    Model FLOPs: 2 x the matmul parameters per token, over every prompt and output token (attention
    excluded), divided by the wall time: what the weights' matmuls alone had to deliver."""
    return {
        "wall_s": wall_s,
        "output_tokens": output_tokens,
        "prompt_tokens": prompt_tokens,
        "output_tokens_per_s": output_tokens / wall_s if wall_s > 0 else None,
        "ttft_ms": latency_summary(ttft_s),
        "model_gflops": flops_per_token * (output_tokens + prompt_tokens) / wall_s / 1e9 if wall_s > 0 else None,
    }
