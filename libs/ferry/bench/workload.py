"""The seeded benchmark workload of shared/BENCHMARKS.md, shared by the offline and HTTP benches.

Prompt lengths are log-normal (median ~100 tokens, clipped to 16..1024), output lengths are drawn
from {16, 32, 64, 128, 128, 256}, prompts are random token ids (the bench model has random
weights, so text would mean nothing), optionally all starting with one shared prefix (a system
prompt, for prefix caching). Arrivals are all at once or a Poisson process. The same config and
seed give the same requests and arrival times in every process, so every system gets the same load.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

import numpy as np


@dataclass(slots=True)
class WorkloadConfig:
    num_requests: int = 128
    seed: int = 0
    prompt_len_median: int = 100
    prompt_len_sigma: float = 0.8
    """Sigma of the log-normal prompt length (in log space)."""
    min_prompt_len: int = 16
    max_prompt_len: int = 1024
    output_lens: tuple[int, ...] = (16, 32, 64, 128, 128, 256)
    """Output lengths to draw from uniformly (repeats weight a length)."""
    vocab_size: int = 2048
    first_token_id: int = 16
    """Prompt token ids are drawn from [first_token_id, vocab_size): skips special tokens."""
    shared_prefix_len: int = 0
    """Tokens every prompt starts with (counted in its length; 0 = no shared prefix)."""

    def __post_init__(self) -> None:
        for name in ("num_requests", "prompt_len_median", "min_prompt_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"WorkloadConfig.{name}={getattr(self, name)}: must be >= 1")
        if self.max_prompt_len < self.min_prompt_len:
            raise ValueError(f"WorkloadConfig.max_prompt_len={self.max_prompt_len}: must be >= min_prompt_len")
        if not self.output_lens or min(self.output_lens) < 1:
            raise ValueError(f"WorkloadConfig.output_lens={self.output_lens}: need lengths >= 1")
        if not 0 <= self.first_token_id < self.vocab_size:
            raise ValueError(f"WorkloadConfig.first_token_id={self.first_token_id}: must be in [0, vocab_size)")
        if not 0 <= self.shared_prefix_len < self.max_prompt_len:
            raise ValueError(
                f"WorkloadConfig.shared_prefix_len={self.shared_prefix_len}: must be in [0, max_prompt_len)"
            )


@dataclass(slots=True)
class WorkloadRequest:
    index: int
    """Position in the workload: pairs results across systems."""
    prompt_token_ids: list[int]
    max_tokens: int
    """Exactly this many output tokens are wanted (use ignore_eos / min_tokens)."""


BURST = {"num_requests": 48, "prompt_len_median": 100, "min_prompt_len": 16, "max_prompt_len": 600}
"""Issue #22's burst, as a user meets it: 48 streaming completions sent at once, prompts log-normal
(~16-600 words), outputs drawn from {16..256}, greedy and with no ignore_eos (its requests carry
only max_tokens: `BURST_LENGTH_CONTROL`)."""
BURST_LENGTH_CONTROL = "none"
NAMED_WORKLOADS = {"default": {}, "burst": BURST}
"""`--workload NAME` -> the WorkloadConfig fields it sets (the rest keep their defaults)."""


def named_workload(name: str, **overrides) -> WorkloadConfig:
    """A WorkloadConfig from a NAMED_WORKLOADS preset, with explicit `overrides` on top."""
    if name not in NAMED_WORKLOADS:
        raise ValueError(f"workload {name!r}: choose from {sorted(NAMED_WORKLOADS)}")
    return WorkloadConfig(**{**NAMED_WORKLOADS[name], **overrides})


def make_workload(cfg: WorkloadConfig) -> list[WorkloadRequest]:
    rng = random.Random(cfg.seed)
    prefix = [rng.randrange(cfg.first_token_id, cfg.vocab_size) for _ in range(cfg.shared_prefix_len)]
    requests = []
    for index in range(cfg.num_requests):
        length = round(math.exp(rng.gauss(math.log(cfg.prompt_len_median), cfg.prompt_len_sigma)))
        length = min(max(length, cfg.min_prompt_len, cfg.shared_prefix_len + 1), cfg.max_prompt_len)
        tail = [rng.randrange(cfg.first_token_id, cfg.vocab_size) for _ in range(length - len(prefix))]
        requests.append(WorkloadRequest(index, prefix + tail, rng.choice(cfg.output_lens)))
    return requests


def poisson_arrivals(num_requests: int, rate_rps: float, seed: int = 0) -> list[float]:
    """Arrival offsets in seconds from the start; rate_rps = inf means all at once."""
    if math.isinf(rate_rps):
        return [0.0] * num_requests
    if rate_rps <= 0:
        raise ValueError(f"rate_rps={rate_rps}: must be > 0 (or inf)")
    rng = random.Random(seed + 1_000_003)  # its own stream: arrivals do not shift the prompts
    t, arrivals = 0.0, []
    for _ in range(num_requests):
        arrivals.append(t)
        t += rng.expovariate(rate_rps)
    return arrivals


def percentile_ms(values_s: list[float], q: float) -> float | None:
    """q-th percentile (0..100) of seconds, in ms; None when empty."""
    if not values_s:
        return None
    return float(np.percentile(np.asarray(values_s, dtype=np.float64), q) * 1000.0)


def latency_summary(values_s: list[float]) -> dict:
    """p50 / p99 / mean in ms of a list of seconds."""
    mean = float(np.mean(values_s)) * 1000.0 if values_s else None
    return {
        "p50": percentile_ms(values_s, 50),
        "p99": percentile_ms(values_s, 99),
        "mean": mean,
        "count": len(values_s),
    }
