"""The multi-turn bench's README.md and its one plot (TTFT p50 per turn, prefetch off vs on)."""

from __future__ import annotations

from pathlib import Path

from ferry.bench import multiturn_trace


def write_markdown(path: Path, report: dict) -> None:
    modes, ratios, config = report["modes"], report["ratios"], report["config"]
    restarted = "every worker" if config.get("restart") == "all" else "the decode worker"
    lines = [
        "# Multi-turn bench: KV prefetch off vs on",
        "",
        f"{config['num_users']} users x {config['num_turns']} turns (+1 after {restarted} restarts), system prompt "
        f"{config['system_prompt_len']} tokens, user messages ~{config['user_len_median']}, answers "
        f"{config['output_len']} tokens, think time ~{config['think_time_s']} s; model {Path(config['model']).name}.",
        "'off': no host tier, no decode write-back, no prefetch. 'on': all three. Modes run one after the other.",
        f"Prefill worker pool: {config['prefill_kv_blocks']} blocks. Command: `{report.get('command', '')}`",
        *_warmup_lines(config, modes),
        "",
        "| turn | TTFT p50 off (ms) | TTFT p50 on (ms) | off/on | TTFT p99 off | TTFT p99 on |",
        "|---|---|---|---|---|---|",
    ]
    for turn, off in modes["off"]["turns"]["ttft_ms_by_turn"].items():
        on = modes["on"]["turns"]["ttft_ms_by_turn"].get(turn, {})
        r = ratios["ttft_p50_off_over_on_by_turn"].get(turn)
        lines.append(
            f"| {turn} | {_f(off['p50'])} | {_f(on.get('p50'))} | {_f(r, 2)} | {_f(off['p99'])} | {_f(on.get('p99'))} |"
        )
    restart = {m: modes[m]["after_restart"]["ttft_ms_turn_2_on"] for m in modes}
    r = ratios["ttft_p50_off_over_on_after_restart"]
    cells = [
        _f(restart["off"]["p50"]),
        _f(restart["on"]["p50"]),
        _f(r, 2),
        _f(restart["off"]["p99"]),
        _f(restart["on"]["p99"]),
    ]
    tokens_per_s = {m: _f(modes[m]["turns"]["output_tokens_per_s"], 1) for m in modes}
    lines += [
        "| after restart | " + " | ".join(cells) + " |",
        "",
        f"Turns >= 2, TTFT p50 off/on: **{_f(ratios['ttft_p50_off_over_on_turn_2_on'], 2)}x** (target >= 3x).",
        f"Output tokens/s on/off: **{_f(ratios['throughput_on_over_off'], 3)}** "
        f"(off {tokens_per_s['off']}, on {tokens_per_s['on']}).",
        "",
        "Prefill worker's admitted prompt blocks by tier (turns 1..N; then the turn after the restart), and the",
        "tokens it copied from cached partial last blocks instead of computing them (partial tok.):",
        "",
        "| mode | device | host | remote | computed | partial tok. | after restart: device | host | remote "
        "| computed | partial tok. |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for mode, data in modes.items():
        before, after = data["prefix_blocks_by_tier"], data["after_restart"]["prefix_blocks_by_tier"]
        keys = ("device", "host", "remote", "computed", "partial_tokens")
        cells = [str(before.get(k, "")) for k in keys] + [str(after.get(k, "")) for k in keys]
        lines.append(f"| {mode} | " + " | ".join(cells) + " |")
    errors = {m: modes[m]["turns"]["num_errors"] + modes[m]["after_restart"]["num_errors"] for m in modes}
    lines += ["", f"Errors: {errors}", *multiturn_trace.markdown(modes), ""]
    path.write_text("\n".join(lines))


def write_plot(path: Path, report: dict) -> None:
    from ferry.bench.plots import pyplot, save_figure

    plt = pyplot()
    modes = report["modes"]
    turns = list(modes["off"]["turns"]["ttft_ms_by_turn"])
    labels = turns + ["restart"]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    width = 0.4
    for i, mode in enumerate(("off", "on")):
        values = [modes[mode]["turns"]["ttft_ms_by_turn"].get(t, {}).get("p50") or 0 for t in turns]
        values.append(modes[mode]["after_restart"]["ttft_ms_turn_2_on"]["p50"] or 0)
        ax.bar([x + (i - 0.5) * width for x in range(len(labels))], values, width, label=f"prefetch {mode}")
    ax.set_xticks(range(len(labels)), labels)
    ax.set_xlabel("turn")
    ax.set_ylabel("TTFT p50 (ms)")
    ax.legend()
    save_figure(fig, path)


def _warmup_lines(config: dict, modes: dict) -> list[str]:
    if not config.get("warmup_users"):
        return ["No warm-up: turn 1 of the first mode also pays the processes' first-request costs."]
    first = {m: _p50_turn_1(modes[m].get("warmup")) for m in modes}
    again = {m: _p50_turn_1(modes[m].get("warmup_after_restart")) for m in modes}
    return [
        f"Warm-up: each mode first runs one turn of {config['warmup_users']} unrelated conversations (another "
        f"seed: no shared blocks), not counted; its TTFT p50 off {first['off']} ms, on {first['on']} ms."
        + (
            f" Again after the restart (TTFT p50 off {again['off']} ms, on {again['on']} ms)."
            if any(m.get("warmup_after_restart") for m in modes.values())
            else ""
        )
    ]


def _p50_turn_1(summary: dict | None) -> str:
    return _f((summary or {}).get("ttft_ms_by_turn", {}).get("1", {}).get("p50"))


def _f(value, digits: int = 0) -> str:
    return "-" if value is None else f"{value:.{digits}f}"
