"""`ferry bench --offline --trace ...`: SLO goodput over a trace, adaptive batch cap vs fixed caps.

Every system is the same engine (continuous batching, the same KV pool) on the same trace, side
by side in one process on their own clocks (ferry.bench.offline_turns: each clock advances by
the system's own measured work and jumps over idle gaps, so a compressed day costs only the
work in it). Systems: `adaptive` (AdaptiveLimits: the step-time model learned online from this
engine's own steps, the token mix from its arrivals, the cap and chunk budget chosen before every
step to keep predicted p90 TPOT within the target) and `fixed-<cap>` for every fixed cap (the
engine's default 2048-token step budget, as a server configured with FERRY_MAX_NUM_SEQS runs).
With `slo_fixed`, also `slo-fixed-<cap>` for every fixed cap: the same SLO admission as adaptive
(on-time order, TPOT-slack chunk) with the cap held there, so the report separates what the cap's
adaptation adds from what the admission adds.

Goodput: requests meeting BOTH targets (TTFT <= ttft_slo_ms, TPOT <= tpot_slo_ms; TPOT is a
request's mean inter-token time) per second of trace. Also SLO attainment per time window of
arrivals, and the adaptive cap over time. Writes report.json, README.md and PNG plots.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch

from ferry.bench.offline_turns import RunResult, engine_config, engine_turns, side_by_side
from ferry.bench.slo_capacity import peak_window_rps, probe_capacity
from ferry.bench.slo_report import write_markdown, write_plots
from ferry.bench.trace import DayNightConfig, day_night_trace, peak_mix_requests, read_trace_file, replay_trace
from ferry.bench.workload import WorkloadRequest, percentile_ms
from ferry.engine.adaptive import AdaptiveLimits
from ferry.model import load_model
from ferry.slo import ControllerLimits, ForecastConfig, SloTargets

FORECAST_INTERVALS_PER_DAY = 48
ABLATION = "adaptive-fcfs"
SLO_FIXED = "slo-fixed-"
PROBE_REQUESTS = 24


@dataclass(slots=True)
class SloBenchConfig:
    model: Path
    out_dir: Path
    trace: str = "day-night"
    """'day-night' or a Mooncake (.jsonl) / Azure (.csv) trace file."""
    day_night: DayNightConfig = field(default_factory=DayNightConfig)
    tpot_slo_ms: float = 50.0
    ttft_slo_ms: float = 2000.0
    fixed_caps: tuple[int, ...] = (8, 16, 32, 64, 128)
    adaptive_max_num_seqs: int = 256
    num_kv_blocks: int = 2048
    threads: int = 2
    peak_load: float | None = None
    """Scale the trace to the machine: its peak arrival rate is this many times the SLO capacity
    measured before the run (ferry.bench.slo_capacity). day-night: sets day_night.peak_rps;
    a replay: sets trace_speedup (its peak: the busiest 1/num_windows of the trace)."""
    trace_speedup: float = 1.0
    max_requests: int | None = None
    max_output_len: int = 256
    num_windows: int = 24
    ablation: bool = False
    """Also run `adaptive-fcfs` beside `adaptive`: the same adaptive cap and chunk budget, without
    SloController.admit (no queue reordering, no TPOT-slack prefill, no seats beyond the cap)."""
    ablation_itl_factors: tuple[float, ...] = ()
    """Also run `adaptive-fcfs-itl<F>` for each F: the ablation with ControllerLimits.max_itl_factor
    F (the FCFS chunk rule: a step with deferrable prefill may take F TPOT targets; default 4):
    an A/B of that rule in one run."""
    slo_fixed: bool = False
    """Also run `slo-fixed-<cap>` for each fixed cap: SloController.admit with the cap held
    (AdaptiveLimits.fixed_cap: no plan, no seats beyond it)."""
    show_progress: bool = True

    def __post_init__(self) -> None:
        if not self.fixed_caps or min(self.fixed_caps) < 1:
            raise ValueError(f"SloBenchConfig.fixed_caps={self.fixed_caps}: need caps >= 1")
        SloTargets(self.tpot_slo_ms, self.ttft_slo_ms)  # validates both
        if self.num_windows < 1:
            raise ValueError(f"SloBenchConfig.num_windows={self.num_windows}: must be >= 1")
        if self.peak_load is not None and not self.peak_load > 0:
            raise ValueError(f"SloBenchConfig.peak_load={self.peak_load}: must be > 0")


def load_trace(cfg: SloBenchConfig, lm) -> tuple[list[WorkloadRequest], list[float], dict]:
    """The trace's requests, arrival times and a description for the report; with peak_load, the
    capacity probe runs first and scales the trace (the probe's findings go in the description)."""
    vocab_size, targets = lm.config.vocab_size, SloTargets(cfg.tpot_slo_ms, cfg.ttft_slo_ms)
    if cfg.trace == "day-night":
        dn = cfg.day_night
        dn.vocab_size = vocab_size
        capacity = None
        if cfg.peak_load is not None:
            capacity = probe_capacity(lm, peak_mix_requests(dn, PROBE_REQUESTS), targets, cfg.num_kv_blocks)
            dn.peak_rps = cfg.peak_load * capacity["capacity_rps"]
        requests, arrivals, bursts = day_night_trace(dn)
        info = {"kind": "day-night", **asdict(dn), "bursts_s": bursts, "duration_s": dn.duration_s}
        return requests, arrivals, {**info, "peak_load": cfg.peak_load, "capacity": capacity}
    records = read_trace_file(Path(cfg.trace))

    def replay(speedup: float) -> tuple[list[WorkloadRequest], list[float]]:
        return replay_trace(
            records, speedup, cfg.day_night.max_prompt_len, cfg.max_output_len, vocab_size, cfg.max_requests
        )

    requests, arrivals = replay(cfg.trace_speedup)
    capacity = peak_rps = None
    if cfg.peak_load is not None:
        sample = requests[:: max(len(requests) // PROBE_REQUESTS, 1)][:PROBE_REQUESTS]
        capacity = probe_capacity(lm, sample, targets, cfg.num_kv_blocks)
        peak_rps = peak_window_rps(arrivals, max(arrivals[-1], 1e-3) / cfg.num_windows)
        cfg.trace_speedup *= cfg.peak_load * capacity["capacity_rps"] / peak_rps
        requests, arrivals = replay(cfg.trace_speedup)
    duration = max(arrivals[-1], 1e-3)
    info = {"kind": "replay", "file": cfg.trace, "speedup": cfg.trace_speedup, "duration_s": duration}
    return requests, arrivals, {**info, "peak_load": cfg.peak_load, "peak_rps_unscaled": peak_rps, "capacity": capacity}


def run_slo_bench(cfg: SloBenchConfig) -> dict:
    torch.set_num_threads(cfg.threads)
    lm = load_model(cfg.model)
    requests, arrivals, trace = load_trace(cfg, lm)
    targets = SloTargets(cfg.tpot_slo_ms, cfg.ttft_slo_ms)
    adaptive = _adaptive(cfg, trace["duration_s"], targets, admission=True)
    controllers = {"adaptive": adaptive}
    if cfg.ablation:
        controllers[ABLATION] = _adaptive(cfg, trace["duration_s"], targets, admission=False)
    for factor in cfg.ablation_itl_factors:
        controllers[f"{ABLATION}-itl{factor:g}"] = _adaptive(cfg, trace["duration_s"], targets, False, factor)
    if cfg.slo_fixed:
        for cap in cfg.fixed_caps:
            controllers[f"{SLO_FIXED}{cap}"] = _adaptive(cfg, trace["duration_s"], targets, True, fixed_cap=cap)
    turns = {}
    for name, c in controllers.items():  # a held cap runs an engine of that cap, as fixed-<cap> does
        cap = c.fixed_cap or cfg.adaptive_max_num_seqs
        turns[name] = engine_turns(lm, _config(cfg, cap), requests, arrivals, name, adaptive=c)
    for cap in cfg.fixed_caps:
        turns[f"fixed-{cap}"] = engine_turns(lm, _config(cfg, cap), requests, arrivals, f"fixed-{cap}")
    results = side_by_side(turns, len(requests) * len(turns), cfg.show_progress)
    results = {name: results[name] for name in turns}  # adaptive first, then the caps in order
    report = build_report(cfg, trace, requests, arrivals, results, controllers, targets)
    cfg.out_dir.mkdir(parents=True, exist_ok=True)
    report["plots"] = write_plots(cfg.out_dir, report)
    (cfg.out_dir / "report.json").write_text(json.dumps(report, indent=1, default=str))
    write_markdown(cfg.out_dir, report)
    return report


def _adaptive(
    cfg: SloBenchConfig,
    duration_s: float,
    targets: SloTargets,
    admission: bool,
    itl_factor: float | None = None,
    fixed_cap: int | None = None,
) -> AdaptiveLimits:
    day_s = cfg.day_night.day_s if cfg.trace == "day-night" else duration_s
    forecast = ForecastConfig(
        interval_s=day_s / FORECAST_INTERVALS_PER_DAY, season_intervals=FORECAST_INTERVALS_PER_DAY, horizon_intervals=2
    )
    limits = ControllerLimits(max_num_seqs=cfg.adaptive_max_num_seqs, fixed_num_seqs=32)
    if itl_factor is not None:
        limits = replace(limits, max_itl_factor=itl_factor)
    return AdaptiveLimits(
        targets, limits, role="both", forecast=forecast, keep_history=True, admission=admission, fixed_cap=fixed_cap
    )


def _config(cfg: SloBenchConfig, cap: int):
    return engine_config("dynamic", cap, cfg.num_kv_blocks, max(2048, cap))


# ---- report --------------------------------------------------------------------------------------
def per_request(result: RunResult, requests: list[WorkloadRequest]) -> dict[int, tuple[float, float | None]]:
    """Request index -> (TTFT s, TPOT s or None for one-token outputs)."""
    tpots = iter(result.tpot_s)  # RunResult keeps a TPOT only for outputs of 2+ tokens, in finish order
    return {
        i: (ttft, next(tpots) if requests[i].max_tokens > 1 else None)
        for i, ttft in zip(result.request_indices, result.ttft_s)
    }


def meets(ttft_s: float, tpot_s: float | None, targets: SloTargets) -> bool:
    return ttft_s * 1000 <= targets.ttft_ms and (tpot_s is None or tpot_s * 1000 <= targets.tpot_ms)


def build_report(cfg, trace, requests, arrivals, results, controllers, targets) -> dict:
    duration = trace["duration_s"]
    edges = [duration * k / cfg.num_windows for k in range(cfg.num_windows + 1)]
    window_of = [min(int(a / duration * cfg.num_windows), cfg.num_windows - 1) for a in arrivals]
    systems: dict[str, dict] = {}
    windows: dict[str, object] = {"start_s": edges[:-1], "offered_rps": _offered(window_of, edges)}
    for name, result in results.items():
        rows = per_request(result, requests)
        good = {i for i, (ttft, tpot) in rows.items() if meets(ttft, tpot, targets)}
        systems[name] = _summary(result, rows, good, duration)
        windows[name] = _attainment(window_of, good, cfg.num_windows)
    for name, controller in controllers.items():
        if controller.fixed_cap is None:
            windows[f"{name}_cap"] = _cap_windows(controller, edges)
            systems[name]["cap_changes"] = cap_changes(controller.history or [])
    best_fixed = max((n for n in systems if n.startswith("fixed-")), key=lambda n: systems[n]["goodput_rps"])
    best = systems[best_fixed]["goodput_rps"]
    ceiling = len(requests) / duration / best if best else None
    ratios = {
        f"{name}_goodput_vs_best_fixed": systems[name]["goodput_rps"] / best if best else None for name in controllers
    }
    slo_fixed = [n for n in systems if n.startswith(SLO_FIXED)]
    best_slo_fixed = max(slo_fixed, key=lambda n: systems[n]["goodput_rps"]) if slo_fixed else None
    if best_slo_fixed is not None:
        base = systems[best_slo_fixed]["goodput_rps"]
        ratios["adaptive_goodput_vs_best_slo_fixed"] = systems["adaptive"]["goodput_rps"] / base if base else None
    return {
        "kind": "slo_trace",
        "model": str(cfg.model),
        "threads": cfg.threads,
        "targets": {"tpot_ms": targets.tpot_ms, "ttft_ms": targets.ttft_ms},
        "trace": {**trace, "num_requests": len(requests)},
        "config": {k: str(v) if isinstance(v, Path) else v for k, v in asdict(cfg).items() if k != "day_night"},
        "systems": systems,
        "best_fixed": best_fixed,
        "best_slo_fixed": best_slo_fixed,
        "ratios": {**ratios, "ceiling_vs_best_fixed": ceiling},
        "windows": windows,
        "step_model": controllers["adaptive"].model.snapshot(),
    }


def _summary(result: RunResult, rows: dict, good: set[int], duration: float) -> dict:
    ttfts = [t for t, _ in rows.values()]
    tpots = [p for _, p in rows.values() if p is not None]
    return {
        "goodput_rps": len(good) / duration,
        "slo_attainment": len(good) / max(len(rows), 1),
        "num_completed": len(rows),
        "num_good": len(good),
        "busy_s": result.busy_s,
        "ttft_ms": {f"p{q}": percentile_ms(ttfts, q) for q in (50, 90, 99)},
        "tpot_ms": {f"p{q}": percentile_ms(tpots, q) for q in (50, 90, 99)},
        "engine": result.engine_stats,
    }


def _offered(window_of: list[int], edges: list[float]) -> list[float]:
    counts = [0] * (len(edges) - 1)
    for w in window_of:
        counts[w] += 1
    return [c / (edges[k + 1] - edges[k]) for k, c in enumerate(counts)]


def _attainment(window_of: list[int], good: set[int], num_windows: int) -> list[float | None]:
    total, ok = [0] * num_windows, [0] * num_windows
    for i, w in enumerate(window_of):
        total[w] += 1
        ok[w] += i in good
    return [o / t if t else None for o, t in zip(ok, total)]


def cap_changes(history: list) -> dict[str, int]:
    """How often the cap moved from one step to the next: as planned, after the smoothing, and in
    force (with the seats admission adds)."""
    counts = {"steps": len(history), "planned": 0, "smoothed": 0, "in_force": 0}
    for before, after in zip(history, history[1:]):
        counts["planned"] += before.planned_num_seqs != after.planned_num_seqs
        counts["smoothed"] += before.smoothed_num_seqs != after.smoothed_num_seqs
        counts["in_force"] += before.max_num_seqs != after.max_num_seqs
    return counts


def _cap_windows(adaptive: AdaptiveLimits, edges: list[float]) -> dict[str, list]:
    """Mean cap, mean chunk budget and desired replicas per window of the adaptive run's clock."""
    out: dict[str, list] = {"max_num_seqs": [], "chunk_tokens": [], "desired_replicas": [], "num_late": []}
    history = adaptive.history or []
    for lo, hi in zip(edges, edges[1:]):
        inside = [h for h in history if lo <= h.time_s < hi]
        for key in out:
            values = [getattr(h, key) for h in inside]
            out[key].append(sum(values) / len(values) if values else None)
    return out
