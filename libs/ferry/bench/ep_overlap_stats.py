"""What the dual micro-batch overlap bench's samples say: per mode the step's parts, and the fraction
of the all-to-all time the overlap hides (ferry.bench.ep_overlap takes the samples).

A sample is one rank's step: {"step_s", "a2a_s" (blocked in wait() on the MoE layers' all-to-alls),
"all_gather_s" (the step's all-gather of token counts), "by_collective", "expert_rows", "waits"}.
Steps are taken in triples, one step of each mode back to back (the order rotating), so the i-th
steps of two modes ran within a second of each other: their difference is paired against the box's
drift.

The all-to-all time of a mode is what its all-to-alls add to its step. The ranks of a step end
together (the step's last combine joins them), so the step is the critical rank's compute plus its
waits, the critical rank being the one that computed longest; a rank with less to compute (fewer
expert rows, or its peer descheduled by the VM) also waits that difference out in some collective,
but that is load imbalance, there with any network however fast, and no overlap can hide it at the
step's end (`_ranks_mean` figures keep it: they take the ranks' mean instead). So:

A_seq: the critical rank's time blocked in wait() on the all-to-alls in the sequential mode (each
collective waited on at once: its transfer, and a peer arriving later), median over the steps.
A_ovl: the same in the overlapped mode, plus whatever its compute took longer than the same compute
run sequentially, dC = median over the triples of (overlapped - sequential compute), when positive:
on a CPU gloo's threads copy the bytes through loopback sockets on the same cores as the compute, so
a transfer that leaves wait() may still lengthen the step by slowing the other micro-batch.

    hidden = 1 - A_ovl / A_seq

the fraction of the all-to-all's time that no longer adds to the step. A negative dC (the
overlapped schedule reads a layer's weights for both micro-batches close together, and caches help)
does not count as hidden communication. Beside it: the blocked-time figure (`hidden_blocked_*`,
blind to dC), the step-time figure `hidden_by_step_fraction`: median over the triples of (sequential
step - overlapped step) over A_seq (the same quantity, but carrying the noise of two whole steps: a
rank descheduled in either step moves it by tens of ms), and all of them over the ranks' mean. The
step's all-gather of token counts (once per step in every mode) is not all-to-all time; its time is
reported per mode.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable

from ferry.parallel.overlap import MODES

Step = dict[str, float]
"""One step of the group, aggregated over its ranks (see _group_step)."""


def _group_step(samples: tuple[dict, ...]) -> Step:
    """One step's samples, one per rank -> the group's step (ms): step time of the slowest rank;
    all-to-all blocked time and compute of the critical rank (the one that computed longest: the
    step is its compute plus its waits) and the ranks' mean of both; the ranks' mean all-gather
    time and CPU time of gloo's threads; the exposed all-to-all time (per collective the wait of
    the rank that waited least, summed) and the expert load max/mean."""
    mean = statistics.mean
    rows = [sample["expert_rows"] for sample in samples]
    kinds = sorted({kind for sample in samples for kind in sample["by_collective"]})
    computes = [s["step_s"] - s["a2a_s"] - s["all_gather_s"] for s in samples]
    critical = max(range(len(samples)), key=computes.__getitem__)
    step = {
        "step_ms": 1000 * max(sample["step_s"] for sample in samples),
        "a2a_blocked_ms": 1000 * samples[critical]["a2a_s"],
        "compute_ms": 1000 * computes[critical],
        "a2a_blocked_ms_ranks_mean": 1000 * mean(sample["a2a_s"] for sample in samples),
        "compute_ms_ranks_mean": 1000 * mean(computes),
        "all_gather_ms": 1000 * mean(sample["all_gather_s"] for sample in samples),
        "gloo_cpu_ms": 1000 * mean(sample.get("gloo_cpu_s", 0.0) for sample in samples),
        "exposed_a2a_ms": 1000 * sum(map(min, zip(*(sample["waits"] for sample in samples)))),
        "expert_rows_max_over_mean": max(rows) / max(mean(rows), 1),
    }
    for kind in kinds:
        step[f"a2a_blocked_ms.{kind}"] = 1000 * mean(sample["by_collective"].get(kind, 0.0) for sample in samples)
    return step


def group_steps(per_rank: list[dict], phase: str) -> dict[str, list[Step]]:
    """{mode: [group step, in the order taken]} from every rank's samples of phase."""
    return {mode: [_group_step(row) for row in zip(*(rank[phase][mode] for rank in per_rank))] for mode in MODES}


def _median(steps: list[Step], key: str) -> float:
    return statistics.median(step[key] for step in steps)


def _paired_median(a: list[Step], b: list[Step], key: str) -> float:
    """Median over the triples of a's step minus b's step (the same triple: taken back to back)."""
    assert len(a) == len(b), "modes are sampled in triples"
    return statistics.median(x[key] - y[key] for x, y in zip(a, b))


def mode_summary(steps: list[Step]) -> dict[str, float]:
    """Median of every field over the steps."""
    return {key: _median(steps, key) for key in steps[0]}


def hidden_fractions(steps: dict[str, list[Step]]) -> dict[str, float]:
    """The overlap's hidden fraction of the all-to-all time, and beside it the blocked-time and the
    step-time figures (module docstring)."""
    seq, ovl = steps["sequential"], steps["overlap"]
    out: dict[str, float] = {}
    for suffix in ("", "_ranks_mean"):
        a2a, blocked = _median(seq, f"a2a_blocked_ms{suffix}"), _median(ovl, f"a2a_blocked_ms{suffix}")
        compute_extra = _paired_median(ovl, seq, f"compute_ms{suffix}")
        out |= {
            f"a2a_ms_sequential{suffix}": a2a,
            f"a2a_ms_overlap{suffix}": blocked + max(compute_extra, 0.0),
            f"hidden_fraction{suffix}": 1 - (blocked + max(compute_extra, 0.0)) / a2a,
            f"hidden_blocked_fraction{suffix}": 1 - blocked / a2a,
            f"compute_extra_ms_overlap{suffix}": compute_extra,
        }
    saved = _paired_median(seq, ovl, "step_ms")
    return out | {
        "hidden_by_step_fraction": saved / out["a2a_ms_sequential"],
        "saved_ms": saved,
        "speedup_overlap_vs_sequential": _paired_ratio(seq, ovl),
        "speedup_overlap_vs_single": _paired_ratio(steps["single"], ovl),
    }


def _paired_ratio(a: list[Step], b: list[Step]) -> float:
    return statistics.median(x["step_ms"] / y["step_ms"] for x, y in zip(a, b))


def summarise_phase(per_rank: list[dict], phase: str, steps_per_round: int) -> dict:
    """Per mode the medians over the run; the hidden fractions over the run and per round."""
    steps = group_steps(per_rank, phase)
    num_steps = len(steps["single"])
    if num_steps % steps_per_round:
        raise ValueError(f"{num_steps} {phase} steps per mode are not whole rounds of {steps_per_round}")
    rounds = [slice(r, r + steps_per_round) for r in range(0, num_steps, steps_per_round)]
    per_round = [hidden_fractions({mode: steps[mode][r] for mode in MODES}) for r in rounds]
    column: Callable[[str], list[float]] = lambda key: [fractions[key] for fractions in per_round]  # noqa: E731
    return {
        "modes": {mode: mode_summary(steps[mode]) for mode in MODES},
        "run": hidden_fractions(steps),
        "per_round": {key: column(key) for key in per_round[0]},
        "min_round_hidden_fraction": min(column("hidden_fraction")),
    }


def summarise(per_rank: list[dict], steps_per_round: dict[str, int], host_blocks: bool) -> dict:
    """Both phases. host_blocks False (CUDA: wait() only orders streams) keeps step times only."""
    out = {}
    for phase, per_round in steps_per_round.items():
        summary = summarise_phase(per_rank, phase, per_round)
        if not host_blocks:
            summary = {"modes": {m: {"step_ms": s["step_ms"]} for m, s in summary["modes"].items()}}
        out[phase] = summary
    return out


def plot(report: dict, path) -> None:
    from ferry.bench.plots import pyplot, save_figure

    plt = pyplot()
    fig, axes = plt.subplots(1, len(report["result"]), figsize=(6 * len(report["result"]), 4.5), squeeze=False)
    for ax, (phase, data) in zip(axes[0], report["result"].items()):
        modes = data["modes"]
        bottom = [0.0] * len(MODES)
        for key, label, color in (
            ("compute_ms", "compute (critical rank)", "#48c"),
            ("all_gather_ms", "all-gather of counts", "#aaa"),
            ("a2a_blocked_ms", "blocked in all-to-alls (critical rank)", "#c44"),
        ):
            values = [modes[m].get(key, modes[m]["step_ms"] if key == "compute_ms" else 0.0) for m in MODES]
            ax.bar(MODES, values, bottom=bottom, label=label, color=color)
            bottom = [b + v for b, v in zip(bottom, values)]
        ax.set_ylabel("ms, median step")
        if "per_round" in data:
            rounds = " / ".join(f"{f:.0%}" for f in data["per_round"]["hidden_fraction"])
            ax.set_title(f"{phase}: hidden {data['run']['hidden_fraction']:.0%} (rounds {rounds})", fontsize=9)
        else:
            ax.set_title(phase)
    axes[0][0].legend(fontsize=8)
    params = report["params"]
    fig.suptitle(f"{params['ranks']} ranks, {params['device']}, pin {params['pin']}")
    save_figure(fig, path)
