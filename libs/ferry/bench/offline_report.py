"""The report of `ferry bench --offline`: summaries, ratios, model FLOPs use, and the PNG plots."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ferry.bench.offline_turns import RunResult
from ferry.model import LoadedModel
from ferry.model.quant_linear import QuantLinear

LABELS = {
    "dynamic": "dynamic",
    "static": "static (compacting)",
    "static_padded": "static (padded)",
    "transformers": "transformers",
}
"""'static' drops a finished sequence from compute at once (only live sequences cost); 'static_padded'
is classic static batching on dense tensors (FasterTransformer-era servers, HF generate): prompts
are left-padded to the batch's longest, and a finished slot keeps decoding (its tokens are thrown
away) until the batch's longest member is done."""
STATIC_BASELINES = ("static", "static_padded")
EQUAL_KV_LABEL = (
    "equal KV memory: every engine system gets the same KV pool and batch cap; static admission "
    "reserves prompt + max_tokens per member (it cannot preempt), dynamic allocates as tokens "
    "grow and preempts when the pool runs dry. Not the equal-batch-cap comparison."
)

OnlineRun = tuple[float, float, dict[str, RunResult]]
"""(rate fraction, offered req/s, {system: RunResult}) of one Poisson rate."""


def offline_ratios(offline: dict[str, dict]) -> dict[str, float]:
    """dynamic's output tokens/s over each other system's."""
    dyn = offline.get("dynamic")
    return {
        f"dynamic_vs_{other}_output_tokens_per_s": dyn["output_tokens_per_s"] / summary["output_tokens_per_s"]
        for other, summary in offline.items()
        if dyn and other != "dynamic"
    }


def online_rows(online: list[OnlineRun], basis: str, offline: dict[str, dict]) -> list[dict]:
    rows = []
    for fraction, rate_rps, by_system in online:
        row: dict[str, Any] = {
            "rate_fraction": fraction,
            "rate_basis": basis,
            "offered_rps": rate_rps,
            "load_vs_own_capacity": {s: rate_rps / offline[s]["requests_per_s"] for s in by_system},
            **{s: r.summary() for s, r in by_system.items()},
        }
        for static in STATIC_BASELINES:
            if static in by_system and "dynamic" in by_system:
                p99_ms = row["dynamic"]["e2e_ms"]["p99"], row[static]["e2e_ms"]["p99"]
                row[f"p99_e2e_reduction_vs_{static}"] = 1 - p99_ms[0] / p99_ms[1]
        rows.append(row)
    return rows


def add_flops_use(offline: dict[str, dict], lm: LoadedModel, peak_gflops: float) -> None:
    flops = model_flops_per_token(lm)
    for summary in offline.values():
        if summary["engine"]:
            delivered = flops * summary["engine"]["num_computed_tokens"] / summary["busy_s"] / 1e9
            summary["model_gflops"] = delivered
            summary["model_flops_utilization"] = delivered / peak_gflops


def dense_matmuls(size: int = 1024) -> dict[str, Callable[[], torch.Tensor]]:
    """Every way this torch build multiplies two dense fp32 [size, size] matrices: MKL (`a @ b`) and,
    where torch has oneDNN, oneDNN with the right-hand matrix packed once, which is how ferry's CPU
    model runs its weight matmuls (ferry.model.cpu_linear). The machine's dense rate is the fastest."""
    from ferry.model.cpu_linear import pack

    a, b = torch.randn(size, size), torch.randn(size, size)
    ops = {"mkl": lambda: a @ b}
    packed = pack(b.t().contiguous())  # linear(a, W) = a @ W^T, so W = b^T gives a @ b
    if packed is not None:
        ops["onednn_packed"] = lambda: torch.ops.mkldnn._linear_pointwise(a, packed, None, "none", [], "")
    return ops


def matmul_gflops(seconds: float = 1.0, size: int = 1024) -> float:
    """This machine's dense fp32 matmul rate, measured now (the denominator of model FLOPs use): the
    fastest of dense_matmuls, each timed for `seconds`."""
    rates = []
    for op in dense_matmuls(size).values():
        op()
        count, start = 0, time.perf_counter()
        while time.perf_counter() - start < seconds:
            op()
            count += 1
        rates.append(2 * size**3 * count / (time.perf_counter() - start) / 1e9)
    return max(rates)


def model_flops_per_token(lm: LoadedModel) -> float:
    """2 x the parameters a token multiplies through (embedding lookup excluded)."""
    embed_weight = lm.model.model.embed_tokens.weight
    params = sum(p.numel() for p in lm.model.parameters())
    params += sum(m.in_features * m.out_features for m in lm.model.modules() if isinstance(m, QuantLinear))
    if getattr(lm.model.lm_head, "weight", None) is embed_weight:
        return 2.0 * params  # the tied matrix is also the LM head, which is a matmul
    return 2.0 * (params - embed_weight.numel())


# ---- plots ---------------------------------------------------------------------------------------
def write_plots(
    out_dir: Path,
    results: dict[str, RunResult],
    online: list[OnlineRun],
    basis: str,
    equal_kv: dict[str, RunResult] | None,
    kv_budget: tuple[int, int] | None,
) -> list[str]:
    """kv_budget: (KV pool tokens, batch cap) of the equal-KV-memory runs."""
    names = [_bars(out_dir / "throughput.png", results, "Offline throughput (all at once, equal batch cap)")]
    if online:
        names.append(_latency_cdfs(out_dir / "latency_cdf.png", online, basis))
    if equal_kv:
        assert kv_budget is not None  # the equal-KV-memory runs have one
        names.append(
            _bars(
                out_dir / "equal_kv_memory.png",
                equal_kv,
                f"Offline throughput, EQUAL KV MEMORY ({kv_budget[0]} tokens, cap {kv_budget[1]})",
            )
        )
    return names


def _bars(path: Path, results: dict[str, RunResult], title: str) -> str:
    from ferry.bench.plots import pyplot, save_figure

    plt = pyplot()

    fig, ax = plt.subplots(figsize=(6, 4))
    ax.bar([LABELS[s] for s in results], [r.output_tokens / r.busy_s for r in results.values()], color="tab:blue")
    ax.set_ylabel("output tokens/s")
    ax.set_title(title, fontsize=10)
    save_figure(fig, path)
    return path.name


def _latency_cdfs(path: Path, online: list[OnlineRun], basis: str) -> str:
    from ferry.bench.plots import pyplot, save_figure

    plt = pyplot()

    fig, axes = plt.subplots(1, len(online), figsize=(5 * len(online), 4), squeeze=False)
    for ax, (fraction, rate_rps, by_system) in zip(axes[0], online):
        for system, run in by_system.items():
            values = sorted(v * 1000 for v in run.e2e_s)
            ax.plot(values, [(i + 1) / len(values) for i in range(len(values))], label=LABELS[system])
        ax.set_xlabel("end-to-end latency (ms)")
        ax.set_ylabel("fraction of requests")
        ax.set_title(f"Poisson {rate_rps:.2f} req/s ({fraction:g} x {LABELS[basis]} capacity)", fontsize=10)
        ax.legend()
    save_figure(fig, path)
    return path.name
