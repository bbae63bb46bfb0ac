"""PNG plots of a bench report (matplotlib, Agg backend: no display needed).

Every plot is drawn from the report dict alone (bench.json), so a saved report can be redrawn.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np


def pyplot():
    """matplotlib.pyplot on the Agg backend (headless: CI and servers have no display).

    matplotlib is the optional `bench` extra, imported only when a plot is drawn."""
    try:
        import matplotlib
    except ModuleNotFoundError as exc:
        raise ModuleNotFoundError(
            "plotting a bench report needs matplotlib, the optional extra: pip install 'ferry[bench]'"
        ) from exc
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def write_plots(out_dir: Path, report: dict) -> list[str]:
    """Draw every plot the data allows; returns the file names written (relative to out_dir)."""
    written = []
    for name, draw in (
        ("throughput_vs_load.png", _throughput),
        ("ttft_cdf.png", _ttft_cdf),
        ("itl_cdf.png", _itl_cdf),
        ("batch_size.png", _batch_size),
    ):
        if draw(out_dir / name, report):
            written.append(name)
    return written


def save_figure(fig, path: Path) -> bool:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    pyplot().close(fig)
    return True


def _throughput(path: Path, report: dict) -> bool:
    """Achieved output tokens/s against offered requests/s; the all-at-once phase is a dashed line."""
    rows = [s for s in report["summary"] if s["output_tokens_per_s"] is not None]
    if not rows:
        return False
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    paced = sorted((s["offered_rps"], s["output_tokens_per_s"]) for s in rows if not s["all_at_once"])
    if paced:
        ax.plot([p[0] for p in paced], [p[1] for p in paced], "o-", label="Poisson arrivals")
    for s in rows:
        if s["all_at_once"]:
            ax.axhline(s["output_tokens_per_s"], linestyle="--", color="gray", label=f"{s['name']} (all at once)")
    ax.set_xlabel("offered load (requests/s)")
    ax.set_ylabel("output tokens/s")
    ax.set_title("throughput vs offered load")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return save_figure(fig, path)


def _cdf(path: Path, report: dict, values_of, xlabel: str, title: str) -> bool:
    series = [(p["name"], values_of(p["requests"])) for p in report["phases"]]
    series = [(name, vals) for name, vals in series if vals]
    if not series:
        return False
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    for name, vals in series:
        xs = np.sort(np.asarray(vals, dtype=np.float64) * 1000.0)
        ax.step(xs, np.arange(1, len(xs) + 1) / len(xs), where="post", label=name)
    ax.set_xlabel(xlabel)
    ax.set_ylabel("fraction of samples")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return save_figure(fig, path)


def _ttft_cdf(path: Path, report: dict) -> bool:
    return _cdf(
        path,
        report,
        lambda reqs: [r["ttft_s"] for r in reqs if r["ok"] and r["ttft_s"] is not None],
        "time to first token (ms)",
        "TTFT CDF",
    )


def _itl_cdf(path: Path, report: dict) -> bool:
    def gaps(reqs: list[dict]) -> list[float]:
        return [b - a for r in reqs if r["ok"] for a, b in zip(r["chunk_times_s"], r["chunk_times_s"][1:])]

    return _cdf(path, report, gaps, "inter-token latency (ms)", "inter-token latency CDF")


def _batch_size(path: Path, report: dict) -> bool:
    series = [(p["name"], p["batch_samples"]) for p in report["phases"] if p["batch_samples"]]
    if not series:
        return False
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    for name, samples in series:
        ax.plot([t for t, _ in samples], [v for _, v in samples], label=name)
    ax.set_xlabel("seconds since phase start")
    ax.set_ylabel("running batch size (server metrics)")
    ax.set_title("batch size over time")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return save_figure(fig, path)
