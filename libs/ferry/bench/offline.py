"""`ferry bench --offline`: the engine in-process, dynamic vs static batching vs transformers.

Every system runs in this one process on the same checkpoint, the same seeded workload and the
same thread count, side by side on their own clocks (ferry.bench.offline_turns). The engines run
with detokenize=False (the prompts are random token ids: their text means nothing, and
transformers' generate returns ids too). Three parts:

- Offline, equal batch cap: all requests arrive at once; every system may run max_num_seqs
  sequences; the KV pool is big enough for all. Output tokens/s.
- Online: Poisson arrivals. The rates are fractions of the offline capacity (req/s) of ONE
  baseline, `rate_basis`: static (padded), the classic static server, when it runs, else static
  (compacting). Every engine system runs at each rate; the first fraction is the 'moderate' rate
  of the headline p99 end-to-end reduction, reported against both static variants. Each row also
  says how loaded every system was (offered rate / its own offline capacity).
- Equal KV memory (only with kv_budget_tokens): every engine system gets the same KV pool and a
  lifted batch cap. Static admission reserves prompt + max_tokens per member (a static server
  cannot preempt); dynamic allocates as tokens grow. This is the paged-KV memory argument, kept
  apart from the equal-batch-cap table and labelled as such.

Writes report.json and PNG plots.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from ferry.bench.offline_report import (
    EQUAL_KV_LABEL,
    LABELS,
    OnlineRun,
    add_flops_use,
    matmul_gflops,
    offline_ratios,
    online_rows,
    write_plots,
)
from ferry.bench.offline_turns import (
    ENGINE_SYSTEMS,
    RunResult,
    Turns,
    engine_config,
    engine_turns,
    side_by_side,
    static_batch,
    transformers_turns,
)
from ferry.bench.workload import WorkloadConfig, make_workload, poisson_arrivals
from ferry.engine.config import EngineConfig
from ferry.model import LoadedModel, load_model

SYSTEMS = (*ENGINE_SYSTEMS, "transformers")
__all__ = [
    "LABELS",
    "SYSTEMS",
    "OfflineConfig",
    "RunResult",
    "Turns",
    "engine_turns",
    "run_offline",
    "side_by_side",
    "static_batch",
]


@dataclass(slots=True)
class OfflineConfig:
    model: Path
    out_dir: Path
    workload: WorkloadConfig = field(default_factory=WorkloadConfig)
    max_num_seqs: int = 32
    """Batch cap of every system (engine running cap; transformers batch size)."""
    max_num_batched_tokens: int = 2048
    num_kv_blocks: int = 4096
    weights_dtype: str = "auto"
    """How ferry's engines hold projection weights (load_model's weights_dtype)."""
    systems: tuple[str, ...] = SYSTEMS
    rate_fractions: tuple[float, ...] = (0.5, 0.8)
    """Online arrival rates as fractions of rate_basis's offline requests/s; the first is the
    'moderate' headline rate. () skips the online part."""
    rate_basis: str | None = None
    """The baseline whose capacity sets the online rates; None: static_padded if it runs, else static."""
    online_requests: int = 64
    kv_budget_tokens: int | None = None
    """Equal-KV-memory table: every engine system gets a pool of this many tokens; None skips it."""
    kv_budget_max_num_seqs: int = 128
    """Batch cap of every engine system in the equal-KV-memory table."""
    threads: int = 2
    show_progress: bool = True
    device: str = "cpu"
    """Where the engine systems run ('cuda' for ops/gpu/check.sh); transformers stays on the CPU."""

    @property
    def basis(self) -> str:
        """rate_basis as __post_init__ resolved it."""
        assert self.rate_basis is not None
        return self.rate_basis

    def __post_init__(self) -> None:
        unknown = set(self.systems) - set(SYSTEMS)
        if unknown or not self.systems:
            raise ValueError(f"OfflineConfig.systems={self.systems}: choose from {SYSTEMS}")
        if self.rate_basis is None:
            self.rate_basis = "static_padded" if "static_padded" in self.systems else "static"
        if self.rate_fractions and not {"dynamic", self.rate_basis} <= set(self.systems):
            raise ValueError(
                f"OfflineConfig.rate_fractions: the online part needs 'dynamic' and its rate "
                f"basis {self.rate_basis!r} in systems"
            )
        if self.rate_basis not in ("static", "static_padded"):
            raise ValueError(f"OfflineConfig.rate_basis={self.rate_basis!r}: 'static' or 'static_padded'")
        if any(f <= 0 for f in self.rate_fractions):
            raise ValueError(f"OfflineConfig.rate_fractions={self.rate_fractions}: must be > 0")
        for name in ("max_num_seqs", "num_kv_blocks", "online_requests", "threads", "kv_budget_max_num_seqs"):
            if getattr(self, name) < 1:
                raise ValueError(f"OfflineConfig.{name}={getattr(self, name)}: must be >= 1")
        if self.kv_budget_tokens is not None and self.kv_budget_tokens < 16:
            raise ValueError(f"OfflineConfig.kv_budget_tokens={self.kv_budget_tokens}: must be >= 16 (one block)")

    @property
    def engine_systems(self) -> tuple[str, ...]:
        return tuple(s for s in self.systems if s in ENGINE_SYSTEMS)


def run_offline(cfg: OfflineConfig) -> dict:
    torch.set_num_threads(cfg.threads)
    lm = load_model(cfg.model, device=cfg.device, weights_dtype=cfg.weights_dtype)
    requests = make_workload(cfg.workload)
    at_once = [0.0] * len(requests)
    turns = {
        s: transformers_turns(cfg.model, requests, cfg.max_num_seqs)
        if s == "transformers"
        else engine_turns(lm, _engine_config(cfg, s), requests, at_once, s)
        for s in cfg.systems
    }
    results = side_by_side(turns, len(requests) * len(turns), cfg.show_progress)
    results = {s: results[s] for s in cfg.systems}
    offline = {name: r.summary() for name, r in results.items()}
    online = _run_online(cfg, lm, offline)
    equal_kv = _run_equal_kv(cfg, lm, requests)
    report = _report(cfg, lm, offline, online, equal_kv)
    cfg.out_dir.mkdir(parents=True, exist_ok=True)
    path = cfg.out_dir / "report.json"
    path.write_text(json.dumps(report, indent=2, default=str))  # first: the figures survive a missing matplotlib
    report["plots"] = write_plots(cfg.out_dir, results, online, cfg.basis, equal_kv, _kv_budget(cfg))
    path.write_text(json.dumps(report, indent=2, default=str))
    return report


def _engine_config(
    cfg: OfflineConfig, system: str, num_kv_blocks: int | None = None, max_num_seqs: int | None = None
) -> EngineConfig:
    return engine_config(
        system,
        max_num_seqs or cfg.max_num_seqs,
        num_kv_blocks or cfg.num_kv_blocks,
        cfg.max_num_batched_tokens,
        cfg.device,
    )


def _kv_budget(cfg: OfflineConfig) -> tuple[int, int] | None:
    """(KV pool tokens, batch cap) of the equal-KV-memory runs, if any."""
    return None if cfg.kv_budget_tokens is None else (cfg.kv_budget_tokens, cfg.kv_budget_max_num_seqs)


def _run_online(cfg: OfflineConfig, lm: LoadedModel, offline: dict[str, dict]) -> list[OnlineRun]:
    """Each rate fraction of the rate basis's offline capacity, every engine system side by side."""
    if not cfg.rate_fractions:
        return []
    wl = WorkloadConfig(**{**asdict(cfg.workload), "num_requests": cfg.online_requests, "seed": cfg.workload.seed + 1})
    requests = make_workload(wl)
    capacity_rps = offline[cfg.basis]["requests_per_s"]
    runs = []
    for fraction in cfg.rate_fractions:
        arrivals = poisson_arrivals(len(requests), fraction * capacity_rps, wl.seed)
        turns = {s: engine_turns(lm, _engine_config(cfg, s), requests, arrivals, s) for s in cfg.engine_systems}
        runs.append(
            (fraction, fraction * capacity_rps, side_by_side(turns, len(turns) * len(requests), cfg.show_progress))
        )
    return runs


def _run_equal_kv(cfg: OfflineConfig, lm: LoadedModel, requests) -> dict[str, RunResult] | None:
    """All at once, every engine system with the same KV pool of kv_budget_tokens and a lifted cap."""
    if cfg.kv_budget_tokens is None:
        return None
    num_blocks = cfg.kv_budget_tokens // EngineConfig().block_size
    configs = {s: _engine_config(cfg, s, num_blocks, cfg.kv_budget_max_num_seqs) for s in cfg.engine_systems}
    turns = {s: engine_turns(lm, c, requests, [0.0] * len(requests), s) for s, c in configs.items()}
    return side_by_side(turns, len(turns) * len(requests), cfg.show_progress)


def _report(
    cfg: OfflineConfig,
    lm: LoadedModel,
    offline: dict[str, dict],
    online: list[OnlineRun],
    equal_kv: dict[str, RunResult] | None,
) -> dict:
    ratios = offline_ratios(offline)
    rows = online_rows(online, cfg.basis, offline)
    for key in ("p99_e2e_reduction_vs_static", "p99_e2e_reduction_vs_static_padded"):
        if rows and key in rows[0]:
            ratios[f"moderate_rate_{key}"] = rows[0][key]
    peak = matmul_gflops()
    add_flops_use(offline, lm, peak)
    report = {
        "kind": "offline",
        "model": str(cfg.model),
        "model_fingerprint": lm.fingerprint,
        "threads": cfg.threads,
        "weights_dtype": lm.weights_dtype,
        "config": {**asdict(cfg), "model": str(cfg.model), "out_dir": str(cfg.out_dir)},
        "machine_matmul_gflops": peak,
        "labels": LABELS,
        "ratios": ratios,
        "offline": offline,
        "online_rate_basis": cfg.rate_basis,
        "online": rows,
    }
    if equal_kv is not None:
        summaries = {s: r.summary() for s, r in equal_kv.items()}
        add_flops_use(summaries, lm, peak)
        report["equal_kv_memory"] = {
            "label": EQUAL_KV_LABEL,
            "kv_budget_tokens": cfg.kv_budget_tokens,
            "max_num_seqs": cfg.kv_budget_max_num_seqs,
            "offline": summaries,
            "ratios": offline_ratios(summaries),
        }
    return report
