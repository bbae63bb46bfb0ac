"""`ferry bench --offline`: the engine in-process, dynamic vs static batching vs transformers.

Every system runs in this one process on the same checkpoint, the same seeded workload and the
same thread count. They run side by side: the systems take turns, one unit of work each (an
engine step, a `generate` call), so load from other processes on a shared machine hits them
alike. Each system keeps its own clock, which advances by the measured duration of its own work
(and jumps over idle gaps to the next arrival): throughput and latencies are what the system would
show running alone at that speed. Offline: all requests arrive at once (throughput). Online:
Poisson arrivals at rates set relative to static batching's measured capacity (latency under
load). Writes report.json and PNG plots.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch
from tqdm import tqdm

from ferry.bench.workload import WorkloadConfig, WorkloadRequest, latency_summary, make_workload, poisson_arrivals
from ferry.engine.config import EngineConfig
from ferry.engine.llm_engine import LLMEngine
from ferry.model import LoadedModel, load_model
from ferry.protocol import SamplingParams

SYSTEMS = ("dynamic", "static", "static_padded", "transformers")
LABELS = {"dynamic": "dynamic", "static": "static (compacting)", "static_padded": "static (padded)",
          "transformers": "transformers"}
"""'static' drops a finished sequence from compute at once (only live sequences cost); 'static_padded'
is classic static batching (FasterTransformer-era servers, HF generate): a finished slot keeps
decoding (its tokens are thrown away) until the batch's longest member is done. Both run in the
same engine; padded only changes how many tokens the finished slots are made to generate."""


@dataclass(slots=True)
class OfflineConfig:
    model: Path
    out_dir: Path
    workload: WorkloadConfig = field(default_factory=WorkloadConfig)
    max_num_seqs: int = 32
    """Batch cap of every system (engine running cap; transformers batch size)."""
    max_num_batched_tokens: int = 2048
    num_kv_blocks: int = 4096
    systems: tuple[str, ...] = SYSTEMS
    rate_fractions: tuple[float, ...] = (0.5, 0.8)
    """Online arrival rates as fractions of static batching's offline requests/s; the first is the
    'moderate' headline rate. () skips the online part."""
    online_requests: int = 64
    threads: int = 2
    show_progress: bool = True

    def __post_init__(self) -> None:
        unknown = set(self.systems) - set(SYSTEMS)
        if unknown or not self.systems:
            raise ValueError(f"OfflineConfig.systems={self.systems}: choose from {SYSTEMS}")
        if self.rate_fractions and "static" not in self.systems:
            raise ValueError("OfflineConfig.rate_fractions: online rates are set from 'static': include it")
        if any(f <= 0 for f in self.rate_fractions):
            raise ValueError(f"OfflineConfig.rate_fractions={self.rate_fractions}: must be > 0")
        for name in ("max_num_seqs", "num_kv_blocks", "online_requests", "threads"):
            if getattr(self, name) < 1:
                raise ValueError(f"OfflineConfig.{name}={getattr(self, name)}: must be >= 1")


@dataclass(slots=True)
class RunResult:
    """One system on one arrival schedule; times on the system's own clock (see module doc)."""

    system: str
    rate_rps: float
    busy_s: float = 0.0
    """The system's clock at the end: its own work plus idle gaps waiting for arrivals."""
    output_tokens: int = 0
    ttft_s: list[float] = field(default_factory=list)
    tpot_s: list[float] = field(default_factory=list)
    e2e_s: list[float] = field(default_factory=list)
    engine_stats: dict | None = None

    def summary(self) -> dict:
        n = len(self.e2e_s)
        return {"system": self.system, "offered_rps": None if math.isinf(self.rate_rps) else self.rate_rps,
                "num_requests": n, "busy_s": self.busy_s, "output_tokens": self.output_tokens,
                "output_tokens_per_s": self.output_tokens / self.busy_s, "requests_per_s": n / self.busy_s,
                "ttft_ms": latency_summary(self.ttft_s), "tpot_ms": latency_summary(self.tpot_s),
                "e2e_ms": latency_summary(self.e2e_s), "engine": self.engine_stats}


Turns = Iterator[int]
"""A system under test: each next() does one unit of work (an engine step, a generate call) and
yields how many requests finished in it; its return value is the RunResult."""


def side_by_side(systems: dict[str, Turns], total: int, progress: bool) -> dict[str, RunResult]:
    """Let the systems take turns, one unit of work each, until all are done."""
    results: dict[str, RunResult] = {}
    active = dict(systems)
    with tqdm(total=total, desc="bench", unit="req", disable=not progress) as bar:
        while active:
            for name, turns in list(active.items()):
                try:
                    bar.update(next(turns))
                except StopIteration as done:
                    results[name] = done.value
                    del active[name]
    return results


def engine_turns(lm: LoadedModel, config: EngineConfig, requests: list[WorkloadRequest],
                 arrivals: list[float], name: str) -> Turns:
    """The engine as a system: requests join when its clock passes their arrival time. For
    static_padded every request generates as many tokens as its batch's longest member (the padded
    slots' real cost); it is measured and reported on its own wanted tokens only."""
    wanted = {r.index: r.max_tokens for r in requests}
    if name == "static_padded":
        requests = padded_requests(requests, arrivals, config)
    engine = LLMEngine(lm, config)
    _warm_up(engine)
    before = engine.stats()
    result = RunResult(name, _rate(arrivals), output_tokens=sum(wanted.values()))
    order = sorted(range(len(requests)), key=lambda i: arrivals[i])
    first_s: dict[int, float] = {}
    clock, nxt = 0.0, 0
    while nxt < len(order) or engine.has_unfinished_requests():
        if not engine.has_unfinished_requests() and arrivals[order[nxt]] > clock:
            clock = arrivals[order[nxt]]  # idle until the next arrival
        started = time.perf_counter()
        while nxt < len(order) and arrivals[order[nxt]] <= clock:
            req = requests[order[nxt]]
            engine.add_request(str(req.index), req.prompt_token_ids, _sampling(req))
            nxt += 1
        outputs = engine.step()
        clock += time.perf_counter() - started
        yield _record(outputs, clock, arrivals, first_s, result, wanted)
    result.busy_s = clock
    result.engine_stats = _engine_stats(before, engine.stats(), requests)
    return result


def padded_requests(requests: list[WorkloadRequest], arrivals: list[float],
                    config: EngineConfig) -> list[WorkloadRequest]:
    """Each request made to generate its static batch's longest output. The static scheduler admits
    the waiting queue in order, max_num_seqs at a time, once the previous batch is done; that is
    these groups only when everything arrives at once and a whole batch fits the KV pool."""
    if any(a != 0 for a in arrivals):
        raise ValueError("static_padded: needs every request to arrive at once (offline)")
    size, out = config.max_num_seqs, []
    for start in range(0, len(requests), size):
        group = requests[start : start + size]
        longest = max(r.max_tokens for r in group)
        blocks = sum(-(-(len(r.prompt_token_ids) + longest) // config.block_size) for r in group)
        if blocks > (config.num_kv_blocks or 0):
            raise ValueError(f"static_padded: batch at {start} needs {blocks} KV blocks > num_kv_blocks")
        out += [replace(r, max_tokens=longest) for r in group]
    return out


def _record(outputs, clock: float, arrivals: list[float], first_s: dict[int, float], result: RunResult,
            wanted: dict[int, int]) -> int:
    finished = 0
    for out in outputs:
        i = int(out.request_id)
        first_s.setdefault(i, clock)
        if out.finish_reason is not None:
            num_out = min(out.index + len(out.new_token_ids), wanted[i])  # padded tokens are not output
            result.ttft_s.append(first_s[i] - arrivals[i])
            result.e2e_s.append(clock - arrivals[i])
            if num_out > 1:
                result.tpot_s.append((clock - first_s[i]) / (num_out - 1))
            finished += 1
    return finished


def _engine_stats(before, after, requests: list[WorkloadRequest]) -> dict:
    steps = after.num_steps - before.num_steps
    scheduled = after.mean_batch_size * after.num_steps - before.mean_batch_size * before.num_steps
    cached = after.num_cached_tokens - before.num_cached_tokens
    return {"num_computed_tokens": after.num_computed_tokens - before.num_computed_tokens,
            "num_cached_tokens": cached,
            "kv_hit_rate": cached / sum(len(r.prompt_token_ids) for r in requests),
            "num_preemptions": after.num_preemptions, "num_steps": steps,
            "mean_batch_size": scheduled / max(steps, 1), "kv_blocks_total": after.kv_blocks_total}


def _sampling(req: WorkloadRequest) -> SamplingParams:
    return SamplingParams(max_tokens=req.max_tokens, temperature=0, ignore_eos=True)


def _warm_up(engine: LLMEngine) -> None:
    engine.add_request("warmup", list(range(16, 48)), SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()


def _rate(arrivals: list[float]) -> float:
    return math.inf if all(a == 0 for a in arrivals) else (len(arrivals) - 1) / max(arrivals[-1], 1e-9)


def transformers_turns(model_dir: Path, requests: list[WorkloadRequest], batch_size: int) -> Turns:
    """Hugging Face `generate` in static batches (left-padded), greedy, exact output lengths."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    pad = model.config.pad_token_id if model.config.pad_token_id is not None else 0
    _hf_batch(model, requests[:1], pad, warm_up=True)
    result = RunResult("transformers", math.inf, output_tokens=sum(r.max_tokens for r in requests))
    for i in range(0, len(requests), batch_size):
        batch = requests[i : i + batch_size]
        started = time.perf_counter()
        _hf_batch(model, batch, pad)
        result.busy_s += time.perf_counter() - started
        result.e2e_s += [result.busy_s] * len(batch)
        yield len(batch)
    return result


def _hf_batch(model, batch: list[WorkloadRequest], pad: int, warm_up: bool = False) -> None:
    width = max(len(r.prompt_token_ids) for r in batch)
    ids = torch.full((len(batch), width), pad, dtype=torch.int64)  # [B, S] left-padded
    mask = torch.zeros((len(batch), width), dtype=torch.int64)
    for row, req in enumerate(batch):
        ids[row, width - len(req.prompt_token_ids) :] = torch.tensor(req.prompt_token_ids)
        mask[row, width - len(req.prompt_token_ids) :] = 1
    new = 4 if warm_up else max(r.max_tokens for r in batch)  # rows that want fewer still run: static
    with torch.inference_mode():
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                       do_sample=False, pad_token_id=pad)


def matmul_gflops(seconds: float = 1.0, size: int = 1024) -> float:
    """This machine's dense fp32 matmul rate, measured now (the denominator of model FLOPs use)."""
    a, b = torch.randn(size, size), torch.randn(size, size)
    a @ b
    count, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        a @ b
        count += 1
    return 2 * size**3 * count / (time.perf_counter() - start) / 1e9


def model_flops_per_token(lm: LoadedModel) -> float:
    """2 x the parameters a token multiplies through (embedding lookup excluded)."""
    embed = lm.model.model.embed_tokens.weight.numel()
    params = sum(p.numel() for p in lm.model.parameters())
    if lm.config.tie_word_embeddings:
        embed = 0  # the tied matrix is also the LM head, which is a matmul
    return 2.0 * (params - embed)


# ---- the whole benchmark -------------------------------------------------------------------------
def run_offline(cfg: OfflineConfig) -> dict:
    torch.set_num_threads(cfg.threads)
    lm = load_model(cfg.model)
    requests = make_workload(cfg.workload)
    at_once = [0.0] * len(requests)
    turns = {s: transformers_turns(cfg.model, requests, cfg.max_num_seqs) if s == "transformers"
             else engine_turns(lm, _engine_config(cfg, s), requests, at_once, s) for s in cfg.systems}
    results = side_by_side(turns, len(requests) * len(turns), cfg.show_progress)
    results = {s: results[s] for s in cfg.systems}
    online = _run_online(cfg, lm, results.get("static"))
    report = _report(cfg, lm, results, online)
    cfg.out_dir.mkdir(parents=True, exist_ok=True)
    report["plots"] = _plots(cfg.out_dir, results, online)
    (cfg.out_dir / "report.json").write_text(json.dumps(report, indent=2, default=str))
    return report


def _engine_config(cfg: OfflineConfig, system: str) -> EngineConfig:
    return EngineConfig(num_kv_blocks=cfg.num_kv_blocks, max_num_seqs=cfg.max_num_seqs,
                        max_num_batched_tokens=cfg.max_num_batched_tokens,
                        batching="static" if system == "static_padded" else system)


def _run_online(cfg: OfflineConfig, lm: LoadedModel, static: RunResult | None) -> list[tuple[float, dict]]:
    """-> [(fraction, {system: RunResult})] for each rate fraction of static's capacity."""
    if not cfg.rate_fractions or static is None:
        return []
    wl = WorkloadConfig(**{**asdict(cfg.workload), "num_requests": cfg.online_requests,
                           "seed": cfg.workload.seed + 1})
    requests = make_workload(wl)
    capacity_rps = len(static.e2e_s) / static.busy_s
    runs = []
    for fraction in cfg.rate_fractions:
        arrivals = poisson_arrivals(len(requests), fraction * capacity_rps, wl.seed)
        turns = {s: engine_turns(lm, _engine_config(cfg, s), requests, arrivals, s) for s in ("dynamic", "static")}
        runs.append((fraction, side_by_side(turns, 2 * len(requests), cfg.show_progress)))
    return runs


def _report(cfg: OfflineConfig, lm: LoadedModel, results: dict[str, RunResult], online: list) -> dict:
    offline = {name: r.summary() for name, r in results.items()}
    ratios = {}
    dyn = offline.get("dynamic")
    for other in ("static", "static_padded", "transformers"):
        if dyn and other in offline:
            ratios[f"dynamic_vs_{other}_output_tokens_per_s"] = (
                dyn["output_tokens_per_s"] / offline[other]["output_tokens_per_s"])
    online_rows = []
    for fraction, by_system in online:
        row = {"rate_fraction_of_static_capacity": fraction, **{s: r.summary() for s, r in by_system.items()}}
        row["p99_e2e_reduction_vs_static"] = 1 - (row["dynamic"]["e2e_ms"]["p99"] / row["static"]["e2e_ms"]["p99"])
        online_rows.append(row)
    if online_rows:
        ratios["moderate_rate_p99_e2e_reduction_vs_static"] = online_rows[0]["p99_e2e_reduction_vs_static"]
    peak = matmul_gflops()
    flops = model_flops_per_token(lm)
    for name, summary in offline.items():
        if summary["engine"]:
            delivered = flops * summary["engine"]["num_computed_tokens"] / summary["busy_s"] / 1e9
            summary["model_gflops"] = delivered
            summary["model_flops_utilization"] = delivered / peak
    return {"kind": "offline", "model": str(cfg.model), "model_fingerprint": lm.fingerprint,
            "threads": cfg.threads, "config": {**asdict(cfg), "model": str(cfg.model), "out_dir": str(cfg.out_dir)},
            "machine_matmul_gflops": peak, "labels": LABELS, "ratios": ratios, "offline": offline, "online": online_rows}


def _plots(out_dir: Path, results: dict[str, RunResult], online: list) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = []
    fig, ax = plt.subplots(figsize=(6, 4))
    systems = list(results)
    ax.bar([LABELS[s] for s in systems], [r.output_tokens / r.busy_s for r in results.values()], color="tab:blue")
    ax.set_ylabel("output tokens/s")
    ax.set_title("Offline throughput (all requests at once)")
    fig.tight_layout()
    fig.savefig(out_dir / "throughput.png", dpi=110)
    plt.close(fig)
    names.append("throughput.png")
    if online:
        fig, axes = plt.subplots(1, len(online), figsize=(5 * len(online), 4), squeeze=False)
        for ax, (fraction, by_system) in zip(axes[0], online):
            for system, run in by_system.items():
                values = sorted(v * 1000 for v in run.e2e_s)
                ax.plot(values, [(i + 1) / len(values) for i in range(len(values))], label=system)
            ax.set_xlabel("end-to-end latency (ms)")
            ax.set_ylabel("fraction of requests")
            ax.set_title(f"Poisson {by_system['static'].rate_rps:.2f} req/s ({fraction:g} x static capacity)")
            ax.legend()
        fig.tight_layout()
        fig.savefig(out_dir / "latency_cdf.png", dpi=110)
        plt.close(fig)
        names.append("latency_cdf.png")
    return names
