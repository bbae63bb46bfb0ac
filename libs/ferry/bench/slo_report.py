"""Plots and the markdown summary of an SLO trace report (ferry.bench.slo_bench), from the report dict alone."""

from __future__ import annotations

from pathlib import Path

from ferry.bench.plots import pyplot, save_figure


def write_plots(out_dir: Path, report: dict) -> list[str]:
    written = []
    for name, draw in (
        ("slo_attainment.png", _attainment),
        ("cap_over_time.png", _caps),
        ("goodput.png", _goodput),
    ):
        draw(out_dir / name, report)
        written.append(name)
    return written


def _attainment(path: Path, report: dict) -> None:
    plt, w = pyplot(), report["windows"]
    fig, ax = plt.subplots(figsize=(8, 4.2))
    for name in report["systems"]:
        style = {"linewidth": 2.5, "color": "black"} if name == "adaptive" else {"linewidth": 1, "alpha": 0.8}
        ax.plot(w["start_s"], [v if v is not None else float("nan") for v in w[name]], label=name, **style)
    ax.set(xlabel="trace time (s)", ylabel="SLO attainment (share of arrivals meeting both)", ylim=(-0.02, 1.02))
    rate = ax.twinx()
    rate.fill_between(w["start_s"], w["offered_rps"], step="post", alpha=0.12, color="gray")
    rate.set_ylabel("offered load (req/s, shaded)")
    ax.legend(fontsize=7, loc="lower left")
    t = report["targets"]
    ax.set_title(f"SLO attainment over time (TTFT <= {t['ttft_ms']:g} ms, TPOT <= {t['tpot_ms']:g} ms)")
    save_figure(fig, path)


def _caps(path: Path, report: dict) -> None:
    plt, w = pyplot(), report["windows"]
    fig, ax = plt.subplots(figsize=(8, 4.2))
    caps = w["adaptive_cap"]
    for name, style in (("adaptive", "k-"), ("adaptive-fcfs", "C3-")):
        if f"{name}_cap" in w:
            cap = w[f"{name}_cap"]["max_num_seqs"]
            ax.plot(w["start_s"], [v if v is not None else float("nan") for v in cap], style, lw=2.5)
            ax.lines[-1].set_label(f"{name} cap (mean per window)")
    for name in report["systems"]:
        if name.startswith("fixed-"):
            ax.axhline(int(name.split("-")[1]), ls=":", lw=0.8, color="gray")
    ax.set(xlabel="trace time (s)", ylabel="max running sequences", yscale="log")
    rep = ax.twinx()
    rep.plot(w["start_s"], [v if v is not None else float("nan") for v in caps["desired_replicas"]], "C1--")
    rep.set_ylabel("desired replicas (dashed)")
    ax.legend(fontsize=7, loc="upper left")
    ax.set_title("adaptive batch cap over the trace (dotted: the fixed caps)")
    save_figure(fig, path)


def _goodput(path: Path, report: dict) -> None:
    plt = pyplot()
    names = list(report["systems"])
    fig, ax = plt.subplots(figsize=(7, 3.6))
    values = [report["systems"][n]["goodput_rps"] for n in names]
    ax.bar(names, values, color=["black" if n == "adaptive" else "C0" for n in names])
    ax.set(ylabel="goodput (req/s meeting both targets)", title="goodput over the whole trace")
    save_figure(fig, path)


def write_markdown(out_dir: Path, report: dict) -> None:
    t, tr = report["targets"], report["trace"]
    lines = [
        "# SLO goodput over a trace: adaptive batch cap vs fixed caps",
        "",
        f"Trace: {tr['kind']}, {tr['num_requests']} requests over {tr['duration_s']:.0f} s; "
        f"targets TTFT <= {t['ttft_ms']:g} ms, TPOT <= {t['tpot_ms']:g} ms; model {report['model']}, "
        f"{report['threads']} threads. Ratio adaptive / best fixed ({report['best_fixed']}): "
        f"**{_fmt(report['ratios']['adaptive_goodput_vs_best_fixed'], 2)}x** (the most any system could reach, "
        f"every request good: {_fmt(report['ratios'].get('ceiling_vs_best_fixed'), 2)}x)" + _ablation(report) + ".",
        *_load(tr),
        "",
        "| system | goodput req/s | attainment | completed | TTFT p50 / p90 ms | TPOT p50 / p90 ms | busy s |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, s in report["systems"].items():
        lines.append(
            f"| {name} | {s['goodput_rps']:.3f} | {s['slo_attainment']:.1%} | {s['num_completed']} "
            f"| {_fmt(s['ttft_ms']['p50'])} / {_fmt(s['ttft_ms']['p90'])} | {_fmt(s['tpot_ms']['p50'])} / "
            f"{_fmt(s['tpot_ms']['p90'])} | {s['busy_s']:.1f} |"
        )
    lines += ["", *_changes(report), *[f"![{p}]({p})" for p in report.get("plots", [])], ""]
    (out_dir / "README.md").write_text("\n".join(lines))


def _changes(report: dict) -> list[str]:
    """How often each adaptive system's cap moved step to step (planned / smoothed / in force)."""
    out = []
    for name, s in report["systems"].items():
        c = s.get("cap_changes")
        if c:
            out.append(
                f"- {name}: the cap moved in {c['planned']} of {c['steps']} steps as planned, "
                f"{c['smoothed']} after the smoothing, {c['in_force']} in force (seats included)."
            )
    return [*out, ""] if out else []


def _ablation(report: dict) -> str:
    out = ""
    ratio = report["ratios"].get("adaptive-fcfs_goodput_vs_best_fixed")
    if ratio is not None:
        out += f"; adaptive-fcfs (ablation: adaptive cap, FCFS order): **{ratio:.2f}x**"
    ratio = report["ratios"].get("adaptive_goodput_vs_best_slo_fixed")
    if report.get("best_slo_fixed"):
        out += (
            f"; adaptive / the best fixed cap with the same SLO admission ({report['best_slo_fixed']}): "
            f"**{_fmt(ratio, 2)}x** (what the cap's adaptation adds)"
        )
    return out


def _load(trace: dict) -> list[str]:
    """How the trace was scaled to the machine (--peak-load), if it was."""
    probe = trace.get("capacity")
    if not probe:
        return []
    peak = f"peak {trace['peak_rps']:.2f} req/s" if trace["kind"] == "day-night" else f"speedup {trace['speedup']:.3f}"
    mix = probe["mix"]
    return [
        "",
        f"Load: --peak-load {trace['peak_load']:g} x the probed SLO capacity {probe['capacity_rps']:.3f} req/s "
        f"({peak}); probe: {probe['num_requests']} requests (mean prompt {mix['mean_prompt_tokens']:.0f}, output "
        f"{mix['mean_output_tokens']:.0f} tokens) in {probe['probe_s']:.1f} s, step model "
        f"{probe['step_model']['coefficients_ms']} ms, residual {probe['step_model']['residual_ms']} ms.",
    ]


def _fmt(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"
