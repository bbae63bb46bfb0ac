"""`ferry bench`: the engine offline (`--offline --model DIR`) or a server over HTTP (`--url URL`).

Both modes build the same seeded workload (ferry.bench.workload) from the options below and write a
JSON report plus PNG plots into --out.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from ferry.dtypes import WEIGHTS_DTYPES

DEFAULT_PEAK_LOAD = 2.0
"""day-night's noon rate as a multiple of the measured SLO capacity (issue #20's regime)."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--offline", action="store_true", help="benchmark the engine in-process (needs --model)")
    parser.add_argument(
        "--model", help="checkpoint folder, .gguf file or smollm2 (offline mode; also sizes the workload's vocabulary)"
    )
    parser.add_argument("--out", type=Path, help="report folder (default ops/bench/<mode>/<UTC time>)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    w = parser.add_argument_group("workload (shared/BENCHMARKS.md, seeded)")
    w.add_argument(
        "--workload",
        choices=("default", "burst"),
        default="default",
        help="burst: issue #22's burst (48 requests, prompts 16..600, sent at once, no ignore_eos: "
        "--length-control none); the options below override it",
    )
    w.add_argument("--num-requests", type=int, help="default 128 (burst: 48)")
    w.add_argument("--seed", type=int, default=0)
    w.add_argument("--prompt-len-median", type=int, default=100)
    w.add_argument("--max-prompt-len", type=int, help="default 1024 (burst: 600)")
    w.add_argument("--output-lens", default="16,32,64,128,128,256", help="drawn uniformly (default %(default)s)")
    w.add_argument("--shared-prefix-len", type=int, default=0, help="tokens every prompt shares (0 = none)")
    w.add_argument("--vocab-size", type=int, help="prompt token ids are < this (default: the model's, else 2048)")
    o = parser.add_argument_group("offline bench (--offline)")
    o.add_argument("--systems", default="dynamic,static,static_padded,transformers", help="default %(default)s")
    o.add_argument("--max-num-seqs", type=int, default=32, help="batch cap of every system (default %(default)s)")
    o.add_argument("--num-kv-blocks", type=int, default=4096)
    o.add_argument(
        "--weights-dtype",
        choices=WEIGHTS_DTYPES,
        default="auto",
        help="how ferry's engines hold projection weights (default auto: the checkpoint's)",
    )
    o.add_argument(
        "--rate-fractions",
        default="0.5,0.8",
        help="online Poisson rates as fractions of the rate basis's offline req/s; the first is "
        "the headline 'moderate' rate; empty = skip (default %(default)s)",
    )
    o.add_argument(
        "--rate-basis",
        choices=("static", "static_padded"),
        help="baseline whose offline capacity sets the online rates (default: static_padded, the "
        "classic static server, if it runs, else static)",
    )
    o.add_argument(
        "--kv-budget-tokens",
        type=int,
        help="add an EQUAL KV MEMORY table: every engine system gets a KV pool of this many tokens "
        "(static reserves prompt + max_tokens per member) and --kv-budget-max-num-seqs",
    )
    o.add_argument("--kv-budget-max-num-seqs", type=int, default=128, help="default %(default)s")
    o.add_argument("--online-requests", type=int, default=64)
    o.add_argument("--threads", type=int, default=2, help="torch threads (default %(default)s)")
    o.add_argument("--device", default="cpu", help="engine device: cpu, cuda, cuda:N (default %(default)s)")
    o.add_argument(
        "--ep-size",
        type=int,
        default=1,
        help="N > 1: run the workload on an N-rank expert-parallel group instead and report each "
        "rank's load (requests, tokens, expert tokens, max/mean); a MoE model whose routed experts N divides",
    )
    o.add_argument(
        "--ep-mode",
        choices=("single", "sequential", "overlap"),
        default="single",
        help="with --ep-size: each step as one batch or two micro-batches (default %(default)s)",
    )
    t = parser.add_argument_group("SLO trace bench (--offline --trace): adaptive batch cap vs fixed caps")
    t.add_argument("--trace", help="'day-night' (seeded, compressed diurnal load) or a Mooncake/Azure trace file")
    t.add_argument("--tpot-slo-ms", type=float, default=50.0, help="default %(default)s")
    t.add_argument("--ttft-slo-ms", type=float, default=2000.0, help="default %(default)s")
    t.add_argument("--fixed-caps", default="8,16,32,64,128", help="default %(default)s")
    t.add_argument("--day-s", type=float, default=90.0, help="day-night: one compressed day (default %(default)s)")
    t.add_argument(
        "--peak-load",
        type=float,
        help="scale the trace to this machine: its peak arrival rate = this x the requests/s the engine "
        "serves within --tpot-slo-ms, measured by a short probe before the run (a step model fitted on "
        f"the peak's mix; day-night default {DEFAULT_PEAK_LOAD}: a peak no cap holds, a night that idles; "
        "a replay: sets the speedup from its busiest 1/24)",
    )
    t.add_argument(
        "--peak-rps", type=float, help="day-night: noon arrival rate in req/s, instead of --peak-load (fixed load)"
    )
    t.add_argument(
        "--no-slo-admission",
        action="store_true",
        help="also run adaptive-fcfs beside adaptive: the adaptive cap and chunk budget, FCFS order, no "
        "TPOT-slack prefill or seats beyond the cap (ablation of the SLO admission)",
    )
    t.add_argument(
        "--slo-fixed",
        action="store_true",
        help="also run slo-fixed-<cap> for every --fixed-caps cap: adaptive's SLO admission (on-time order, "
        "TPOT-slack prefill) with the cap held fixed; the ratio to the best of them is what the cap's "
        "adaptation adds beyond the admission",
    )
    t.add_argument(
        "--ablation-itl-factor",
        type=float,
        action="append",
        default=[],
        help="also run adaptive-fcfs-itl<F>: the ablation with this FCFS chunk rule factor (a step with "
        "deferrable prefill may take F TPOT targets; default 4); repeatable, an A/B in one run",
    )
    t.add_argument("--trace-speedup", type=float, help="replay: divide trace times by this (default 1)")
    t.add_argument("--trace-max-requests", type=int, help="replay: the first N requests only")
    from ferry.bench.online import add_url_arguments

    add_url_arguments(parser)  # adds --url and its options
    from ferry.bench.multiturn_run import add_arguments as add_multiturn_arguments

    add_multiturn_arguments(parser)  # adds --multi-turn and its options


def run(args: argparse.Namespace) -> int:
    try:
        return _run(args)
    except ValueError as exc:
        print(f"ferry bench: {exc}", file=sys.stderr)
        return 2


def _run(args: argparse.Namespace) -> int:
    from ferry.bench.workload import BURST_LENGTH_CONTROL, named_workload

    if args.multi_turn:
        from ferry.bench.multiturn_run import run_multiturn

        out = args.out or Path("ops/bench/multiturn") / time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
        return run_multiturn(args, out)
    if bool(args.offline) == bool(args.url):
        raise ValueError("choose one mode: --offline (engine in-process) or --url URL (a server)")
    from ferry.model.source import model_problem

    problem = model_problem(args.model) if args.model else None
    if problem:
        raise ValueError(f"--model {args.model}: {problem}")
    given = {"num_requests": args.num_requests, "max_prompt_len": args.max_prompt_len}
    workload = named_workload(
        args.workload,
        **{k: v for k, v in given.items() if v is not None},
        seed=args.seed,
        prompt_len_median=args.prompt_len_median,
        output_lens=_ints(args.output_lens, "--output-lens"),
        shared_prefix_len=args.shared_prefix_len,
        vocab_size=args.vocab_size or _model_vocab(args.model) or 2048,
    )
    if args.url and args.length_control is None:
        args.length_control = BURST_LENGTH_CONTROL if args.workload == "burst" else "extra"
    out = args.out or Path("ops/bench") / ("offline" if args.offline else "online") / time.strftime(
        "%Y%m%dT%H%M%SZ", time.gmtime()
    )
    if args.url:
        if args.trace:
            raise ValueError("--trace runs the engine in-process: use it with --offline")
        try:
            from ferry.bench.online import run_url
        except ImportError:
            raise ValueError("--url: the HTTP bench is not available in this build") from None

        return run_url(args, workload, str(out), show_progress=not args.no_progress)
    if not args.model:
        raise ValueError("--offline needs --model DIR")
    if args.trace:
        return _run_trace(args, args.out or Path("ops/bench/slo") / time.strftime("%Y%m%dT%H%M%SZ", time.gmtime()))
    if args.ep_size != 1:
        return _run_ep_load(args, workload, out)
    return _run_offline(args, workload, out)


def _run_trace(args: argparse.Namespace, out: Path) -> int:
    from ferry.bench.slo_bench import SloBenchConfig, run_slo_bench
    from ferry.bench.trace import DayNightConfig

    if args.trace != "day-night" and not Path(args.trace).is_file():
        raise ValueError(f"--trace {args.trace}: neither 'day-night' nor a trace file")
    peak_load = _peak_load(args)
    cfg = SloBenchConfig(
        model=Path(args.model),
        out_dir=out,
        trace=args.trace,
        day_night=DayNightConfig(day_s=args.day_s, peak_rps=args.peak_rps or 1.0, seed=args.seed),
        peak_load=peak_load,
        tpot_slo_ms=args.tpot_slo_ms,
        ttft_slo_ms=args.ttft_slo_ms,
        fixed_caps=_ints(args.fixed_caps, "--fixed-caps"),
        num_kv_blocks=args.num_kv_blocks,
        threads=args.threads,
        trace_speedup=args.trace_speedup or 1.0,
        max_requests=args.trace_max_requests,
        ablation=args.no_slo_admission,
        ablation_itl_factors=tuple(args.ablation_itl_factor),
        slo_fixed=args.slo_fixed,
        show_progress=not args.no_progress,
    )
    report = run_slo_bench(cfg)
    goodput = {name: round(s["goodput_rps"], 4) for name, s in report["systems"].items()}
    print(json.dumps({"out": str(out), "ratios": report["ratios"], "goodput_rps": goodput}, indent=2))
    return 0


def _peak_load(args: argparse.Namespace) -> float | None:
    """--peak-load as given, day-night's default when neither it nor --peak-rps is; None: the
    trace's own load (--peak-rps, --trace-speedup)."""
    if args.trace == "day-night":
        if args.peak_rps is not None and args.peak_load is not None:
            raise ValueError("--peak-rps and --peak-load both set the day-night peak: give one")
        if args.peak_rps is not None:
            return None
        return DEFAULT_PEAK_LOAD if args.peak_load is None else args.peak_load
    if args.peak_rps is not None:
        raise ValueError("--peak-rps sets the day-night peak: scale a replay with --peak-load or --trace-speedup")
    if args.peak_load is not None and args.trace_speedup is not None:
        raise ValueError("--peak-load and --trace-speedup both set the replay's speed: give one")
    return args.peak_load


def _run_ep_load(args: argparse.Namespace, workload, out: Path) -> int:
    from ferry.bench.ep_load import run_ep_load
    from ferry.engine.config import EngineConfig

    config = EngineConfig(
        max_num_seqs=args.max_num_seqs, num_kv_blocks=args.num_kv_blocks, device=args.device, detokenize=False
    )
    report = run_ep_load(Path(args.model), workload, out, args.ep_size, args.ep_mode, config)
    print(json.dumps({"out": str(out), "ranks": report["ranks"], "max_over_mean": report["max_over_mean"]}, indent=2))
    return 0


def _run_offline(args: argparse.Namespace, workload, out: Path) -> int:
    from ferry.bench.offline import OfflineConfig, run_offline

    fractions = tuple(float(f) for f in args.rate_fractions.split(",") if f.strip())
    cfg = OfflineConfig(
        model=Path(args.model),
        out_dir=out,
        workload=workload,
        max_num_seqs=args.max_num_seqs,
        num_kv_blocks=args.num_kv_blocks,
        weights_dtype=args.weights_dtype,
        rate_fractions=fractions,
        systems=tuple(s.strip() for s in args.systems.split(",") if s.strip()),
        online_requests=args.online_requests,
        threads=args.threads,
        rate_basis=args.rate_basis,
        kv_budget_tokens=args.kv_budget_tokens,
        kv_budget_max_num_seqs=args.kv_budget_max_num_seqs,
        show_progress=not args.no_progress,
        device=args.device,
    )
    report = run_offline(cfg)
    summary = {
        "out": str(out),
        "ratios": report["ratios"],
        "output_tokens_per_s": {k: v["output_tokens_per_s"] for k, v in report["offline"].items()},
    }
    if "equal_kv_memory" in report:
        summary["equal_kv_memory_ratios"] = report["equal_kv_memory"]["ratios"]
    print(json.dumps(summary, indent=2))
    return 0


def _ints(text: str, option: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise ValueError(f"{option} {text!r}: expected comma-separated integers") from None
    return values


def _model_vocab(model: str | None) -> int | None:
    if not model:
        return None
    from ferry.model.config import read_config

    try:
        return read_config(model).vocab_size
    except (OSError, ValueError) as exc:
        raise ValueError(f"--model {model}: cannot read its vocab_size ({exc})") from None
