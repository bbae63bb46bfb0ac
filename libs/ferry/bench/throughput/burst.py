"""The burst workload as files and calls every system of this harness reads, and the figures they share.

One seeded `ferry.bench.workload.BURST` workload: token-id prompts (JSONL for the offline processes,
one word per id for the HTTP servers), greedy, each request's own max_tokens, no ignore_eos.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

from ferry.bench.workload import WorkloadRequest, latency_summary, make_workload, named_workload
from ferry.model.config import ModelConfig


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


def attention_flops(cfg: ModelConfig, lengths: Iterable[tuple[int, int]]) -> float:
    """FLOPs of attention's two matmuls (Q K^T and P V) over sequences of (prompt, output) tokens.

    The convention of model FLOPs (PaLM's appendix B, without the backward pass): a token at position
    t attends to ctx = t + 1 tokens (fewer under a sliding window), which costs 2 * ctx * (query-key
    width) for the scores and 2 * ctx * (value width) for the weighted sum, per query head and layer.
    Every prompt and output token counts once, like the weight matmuls."""
    if cfg.is_mla:
        width = cfg.num_heads * (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim + cfg.v_head_dim)
    else:
        width = cfg.num_heads * 2 * cfg.head_dim
    total = 0.0
    for prompt, output in lengths:
        n = prompt + output
        for layer in range(cfg.num_layers):
            window = cfg.window(layer)
            if window is None or window >= n:
                contexts = n * (n + 1) / 2  # sum of t + 1 for t < n
            else:  # 1..window, then window for each later token
                contexts = window * (window + 1) / 2 + (n - window) * window
            total += 2.0 * width * contexts
    return total


def figures(
    wall_s: float,
    output_tokens: int,
    prompt_tokens: int,
    ttft_s: list[float],
    flops_per_token: float,
    attention: float = 0.0,
) -> dict:
    """The figures every system reports: throughput over `wall_s`, TTFT, model FLOPs delivered.

    Model FLOPs: 2 x the matmul parameters per token over every prompt and output token, plus
    `attention` (attention_flops of the run's sequences), divided by the wall time; weight_gflops is
    the weight matmuls alone (what reports before 2026-12-04 10:30 called model_gflops)."""
    weights = flops_per_token * (output_tokens + prompt_tokens)
    return {
        "wall_s": wall_s,
        "output_tokens": output_tokens,
        "prompt_tokens": prompt_tokens,
        "output_tokens_per_s": output_tokens / wall_s if wall_s > 0 else None,
        "ttft_ms": latency_summary(ttft_s),
        "model_gflops": (weights + attention) / wall_s / 1e9 if wall_s > 0 else None,
        "weight_gflops": weights / wall_s / 1e9 if wall_s > 0 else None,
        "attention_share_of_flops": attention / (weights + attention) if weights + attention > 0 else None,
    }
