"""Trace workloads for `ferry bench --trace`: a seeded, compressed day-night load, or a public trace.

day-night: one "day" compressed into `day_s` seconds. The arrival rate follows the day (lowest at
midnight, highest at noon: night_fraction of the peak at the trough), with `num_bursts` short
bursts per day at seeded times (rate x burst_factor for burst_s). The token mix follows the day
too: during working hours (morning) most requests are documents (long prompts, short answers:
RAG, summaries), in the evening most are chat (short prompts, long answers). That shift is what
moves the batch cap that a TPOT target allows: a batch of long contexts reads more KV per step.
Arrivals are a non-homogeneous Poisson process (thinning); everything is seeded.

Replay (`load_trace_file`): the Mooncake trace (JSON lines: timestamp ms, input_length,
output_length, hash_ids of 512-token blocks; equal hash ids become equal prompt blocks, so
prefix sharing survives) or the Azure LLM inference trace (CSV: TIMESTAMP, ContextTokens,
GeneratedTokens). Timestamps are made relative and divided by `speedup`; lengths are clipped to
what the model takes.
"""

from __future__ import annotations

import csv
import json
import math
import random
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from ferry.bench.workload import WorkloadRequest

MOONCAKE_BLOCK_TOKENS = 512


@dataclass(slots=True)
class RequestKind:
    prompt_len_median: int
    output_lens: tuple[int, ...]


CHAT = RequestKind(prompt_len_median=100, output_lens=(32, 64, 128, 128))
DOCUMENT = RequestKind(prompt_len_median=700, output_lens=(16, 32, 32, 64))


@dataclass(slots=True)
class DayNightConfig:
    day_s: float = 90.0
    """One compressed day, in seconds."""
    num_days: int = 1
    peak_rps: float = 3.5
    """Arrival rate at noon, bursts excluded."""
    night_fraction: float = 0.15
    """Rate at midnight as a fraction of the peak."""
    num_bursts: int = 4
    """Bursts per day, at seeded times."""
    burst_factor: float = 1.5
    burst_s: float = 3.0
    document_share_work: float = 0.8
    """Share of documents from 06:00 to 13:00 (working hours)."""
    document_share_evening: float = 0.1
    """Share of documents from 13:00 to 22:00."""
    document_share_night: float = 0.3
    seed: int = 0
    vocab_size: int = 2048
    first_token_id: int = 16
    max_prompt_len: int = 1024

    def __post_init__(self) -> None:
        for name in ("day_s", "peak_rps", "burst_factor"):
            if not getattr(self, name) > 0:
                raise ValueError(f"DayNightConfig.{name}={getattr(self, name)}: must be > 0")
        if self.num_days < 1 or self.num_bursts < 0:
            raise ValueError("DayNightConfig.num_days must be >= 1 and num_bursts >= 0")
        for name in ("night_fraction", "document_share_work", "document_share_evening", "document_share_night"):
            if not 0 <= getattr(self, name) <= 1:
                raise ValueError(f"DayNightConfig.{name}={getattr(self, name)}: must be in [0, 1]")

    @property
    def duration_s(self) -> float:
        return self.day_s * self.num_days


def rate_rps(cfg: DayNightConfig, t: float, bursts: list[float]) -> float:
    """The arrival rate at time t (seconds from midnight of day one)."""
    phase = (t % cfg.day_s) / cfg.day_s
    base = cfg.peak_rps * (cfg.night_fraction + (1 - cfg.night_fraction) * (1 - math.cos(2 * math.pi * phase)) / 2)
    in_burst = any(start <= t < start + cfg.burst_s for start in bursts)
    return base * (cfg.burst_factor if in_burst else 1.0)


def document_share(cfg: DayNightConfig, t: float) -> float:
    hour = 24 * (t % cfg.day_s) / cfg.day_s
    if 6 <= hour < 13:
        return cfg.document_share_work
    if 13 <= hour < 22:
        return cfg.document_share_evening
    return cfg.document_share_night


def day_night_trace(cfg: DayNightConfig) -> tuple[list[WorkloadRequest], list[float], list[float]]:
    """(requests, arrival times, burst start times), arrivals ascending, request i arrives at arrivals[i]."""
    rng = random.Random(cfg.seed)
    days = [day * cfg.day_s for day in range(cfg.num_days) for _ in range(cfg.num_bursts)]
    bursts = sorted(start + rng.uniform(0.1, 0.9) * cfg.day_s for start in days)
    max_rate = cfg.peak_rps * cfg.burst_factor
    requests: list[WorkloadRequest] = []
    arrivals: list[float] = []
    t = 0.0
    while True:
        t += rng.expovariate(max_rate)
        if t >= cfg.duration_s:
            return requests, arrivals, bursts
        if rng.random() * max_rate > rate_rps(cfg, t, bursts):
            continue  # thinning: keep an arrival with probability rate(t) / max_rate
        requests.append(draw_request(cfg, t, rng, len(requests)))
        arrivals.append(t)


def draw_request(cfg: DayNightConfig, t: float, rng: random.Random, index: int) -> WorkloadRequest:
    """One request of the mix at time t (a document or a chat turn, by the hour's share)."""
    kind = DOCUMENT if rng.random() < document_share(cfg, t) else CHAT
    length = round(math.exp(rng.gauss(math.log(kind.prompt_len_median), 0.5)))
    length = min(max(length, 16), cfg.max_prompt_len)
    prompt = [rng.randrange(cfg.first_token_id, cfg.vocab_size) for _ in range(length)]
    return WorkloadRequest(index, prompt, rng.choice(kind.output_lens))


def peak_mix_requests(cfg: DayNightConfig, num_requests: int) -> list[WorkloadRequest]:
    """num_requests of the mix at the day's peak (noon), seeded apart from the trace itself."""
    rng = random.Random(f"peak-mix-{cfg.seed}")
    return [draw_request(cfg, cfg.day_s / 2, rng, i) for i in range(num_requests)]


# ---- public traces ---------------------------------------------------------------------------------
@dataclass(slots=True)
class TraceRecord:
    time_s: float
    num_prompt_tokens: int
    num_output_tokens: int
    block_ids: tuple[int, ...] = ()
    """Mooncake hash_ids: equal ids are equal 512-token prompt blocks."""


def read_trace_file(path: Path) -> list[TraceRecord]:
    """Mooncake JSON lines or an Azure LLM inference CSV, by content; times relative to the first."""
    text = Path(path).read_text()
    first = text.lstrip()[:1]
    records = _read_mooncake(text) if first == "{" else _read_azure(text, path)
    if not records:
        raise ValueError(f"--trace {path}: no requests in it")
    records.sort(key=lambda r: r.time_s)
    start = records[0].time_s
    return [TraceRecord(r.time_s - start, r.num_prompt_tokens, r.num_output_tokens, r.block_ids) for r in records]


def _read_mooncake(text: str) -> list[TraceRecord]:
    records = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            records.append(
                TraceRecord(
                    float(row["timestamp"]) / 1000.0,
                    int(row["input_length"]),
                    int(row["output_length"]),
                    tuple(int(h) for h in row.get("hash_ids", ())),
                )
            )
        except (ValueError, KeyError, TypeError) as exc:
            want = "timestamp, input_length, output_length"
            raise ValueError(f"Mooncake trace line {n}: {exc!r} (want {want})") from None
    return records


def _read_azure(text: str, path: Path) -> list[TraceRecord]:
    records = []
    for n, row in enumerate(csv.DictReader(text.splitlines()), 2):
        try:
            when = datetime.fromisoformat(row["TIMESTAMP"].strip()[:26])  # 7-digit fractions: keep 6
            records.append(TraceRecord(when.timestamp(), int(row["ContextTokens"]), int(row["GeneratedTokens"])))
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"{path}: row {n}: {exc!r} (want TIMESTAMP, ContextTokens, GeneratedTokens)") from None
    return records


def replay_trace(
    records: list[TraceRecord],
    speedup: float,
    max_prompt_len: int,
    max_output_len: int,
    vocab_size: int,
    max_requests: int | None = None,
    seed: int = 0,
) -> tuple[list[WorkloadRequest], list[float]]:
    """Requests and arrival times from a trace: time / speedup, lengths clipped, prompts seeded
    (a Mooncake block id always becomes the same tokens)."""
    if not speedup > 0:
        raise ValueError(f"--trace-speedup {speedup}: must be > 0")
    rng = random.Random(seed)
    blocks: dict[int, list[int]] = {}
    requests: list[WorkloadRequest] = []
    arrivals: list[float] = []
    for rec in records[:max_requests]:
        prompt = []
        for block in rec.block_ids:
            if block not in blocks:
                blocks[block] = [rng.randrange(16, vocab_size) for _ in range(MOONCAKE_BLOCK_TOKENS)]
            prompt += blocks[block]
        length = min(max(rec.num_prompt_tokens, 1), max_prompt_len)
        prompt = prompt[:length] + [rng.randrange(16, vocab_size) for _ in range(length - len(prompt[:length]))]
        requests.append(WorkloadRequest(len(requests), prompt, min(max(rec.num_output_tokens, 1), max_output_len)))
        arrivals.append(rec.time_s / speedup)
    return requests, arrivals
