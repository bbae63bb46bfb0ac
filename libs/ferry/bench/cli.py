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


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--offline", action="store_true", help="benchmark the engine in-process (needs --model)")
    parser.add_argument("--model", help="checkpoint folder (offline mode; also sizes the workload's vocabulary)")
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
    from ferry.bench.online import add_url_arguments

    add_url_arguments(parser)  # adds --url and its options


def run(args: argparse.Namespace) -> int:
    try:
        return _run(args)
    except ValueError as exc:
        print(f"ferry bench: {exc}", file=sys.stderr)
        return 2


def _run(args: argparse.Namespace) -> int:
    from ferry.bench.workload import BURST_LENGTH_CONTROL, named_workload

    if bool(args.offline) == bool(args.url):
        raise ValueError("choose one mode: --offline (engine in-process) or --url URL (a server)")
    if args.model and not Path(args.model).is_dir():
        raise ValueError(f"--model {args.model}: no such checkpoint folder")
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
        try:
            from ferry.bench.online import run_url
        except ImportError:
            raise ValueError("--url: the HTTP bench is not available in this build") from None

        return run_url(args, workload, str(out), show_progress=not args.no_progress)
    if not args.model:
        raise ValueError("--offline needs --model DIR")
    return _run_offline(args, workload, out)


def _run_offline(args: argparse.Namespace, workload, out: Path) -> int:
    from ferry.bench.offline import OfflineConfig, run_offline

    fractions = tuple(float(f) for f in args.rate_fractions.split(",") if f.strip())
    cfg = OfflineConfig(
        model=Path(args.model),
        out_dir=out,
        workload=workload,
        max_num_seqs=args.max_num_seqs,
        num_kv_blocks=args.num_kv_blocks,
        rate_fractions=fractions,
        systems=tuple(s.strip() for s in args.systems.split(",") if s.strip()),
        online_requests=args.online_requests,
        threads=args.threads,
        rate_basis=args.rate_basis,
        kv_budget_tokens=args.kv_budget_tokens,
        kv_budget_max_num_seqs=args.kv_budget_max_num_seqs,
        show_progress=not args.no_progress,
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
    config = Path(model) / "config.json"
    try:
        return int(json.loads(config.read_text())["vocab_size"])
    except (OSError, ValueError, KeyError) as exc:
        raise ValueError(f"--model {model}: cannot read vocab_size from {config} ({exc})") from None
