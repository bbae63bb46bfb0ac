"""One comparison run: the same random `bench` checkpoint and the same seeded workload through

  engine-static-padded  ferry's engine in-process, classic static batching (dense: prompts padded to the
                        longest, finished slots keep computing)
  engine-static         ferry's engine in-process, static batching that drops finished sequences
  engine-dynamic        ferry's engine in-process, continuous batching
  ferry-up              the whole system (`ferry up`: gateway, balancers, workers over NATS, KV via Redis)
  hf-serve              `transformers serve <folder> --continuous-batching` on CPU, offline

one after another in this one invocation, each on an otherwise idle server (the engines side by
side, step by step), then writes compare.json, compare.md (issue #9's targets, met or not; ratios;
figures) and compare.png, plus each HTTP system's own `ferry bench --url` report in a subfolder.
Phases: all requests at once (capacity: throughput ratios), then Poisson arrivals at `--rate-fraction`
x `--rate-base`'s all-at-once requests/s, the same rate for everyone (latency ratios).

    .venv/bin/python ops/bench/compare/run.py --num-requests 64 --out ops/bench/compare/reports/<name>
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path

from ferry.bench.compare import engines, ratios, render, servers
from ferry.bench.http_client import CompletionCall
from ferry.bench.online import OnlineConfig, bench_url, detect_model, make_plans, run_phase
from ferry.bench.workload import WorkloadConfig

HTTP_SYSTEMS = ("ferry-up", "hf-serve")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True, help="report folder")
    p.add_argument("--model", type=Path, help="checkpoint folder (default: a fresh `ferry make-model --size bench`)")
    p.add_argument("--systems", default=",".join(ratios.SYSTEMS), help="default %(default)s")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output-lens", default="16,32,64,128,128,256")
    p.add_argument(
        "--rate-fraction",
        type=float,
        default=0.5,
        help="Poisson rate as a fraction of --rate-base's all-at-once req/s; 0 = no Poisson phase",
    )
    p.add_argument(
        "--rate-base",
        choices=tuple(engines.ENGINE_SYSTEMS),
        help="whose all-at-once req/s sets the Poisson rate (default: engine-static-padded, the "
        "classic static server, when it runs, else engine-static; as `ferry bench --offline`)",
    )
    p.add_argument("--rate", type=float, help="Poisson rate in req/s, instead of --rate-fraction x --rate-base")
    p.add_argument("--max-num-seqs", type=int, default=32, help="batch cap of ferry's engine and workers")
    p.add_argument("--num-kv-blocks", type=int, default=4096)
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch/OpenMP threads of every model process (in-process engine, ferry workers, "
        "transformers serve). Default 1: on a busy 2-core box, 2 spinning OpenMP threads made "
        "one engine step ~85x slower",
    )
    p.add_argument("--ready-timeout", type=float, default=300.0)
    p.add_argument("--phase-time-limit", type=float, default=1800.0)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    chosen = servers.parse_systems(args.systems, ratios.SYSTEMS)
    if args.rate is not None and not args.rate > 0:
        raise SystemExit(f"--rate {args.rate}: must be > 0")
    if args.rate_base is None:
        args.rate_base = "engine-static-padded" if "engine-static-padded" in chosen else "engine-static"
    args.out.mkdir(parents=True, exist_ok=True)
    os.environ["OMP_NUM_THREADS"] = str(args.threads)  # inherited by every server process started below
    model_dir = args.model or _make_checkpoint()
    workload = WorkloadConfig(
        num_requests=args.num_requests,
        seed=args.seed,
        output_lens=tuple(int(x) for x in args.output_lens.split(",")),
        vocab_size=json.loads((model_dir / "config.json").read_text())["vocab_size"],
    )
    systems: dict[str, dict[str, dict]] = {}
    problems: dict[str, str] = {}
    stages: dict[str, dict] = {}
    plans = run_engines(args, chosen, model_dir, workload, systems, problems, stages)
    for name in HTTP_SYSTEMS:
        if name in chosen:
            _stage(stages, name, lambda n=name: run_http_system(n, args, model_dir, workload, plans, systems, problems))
    meta = _meta(args, model_dir, workload, plans, stages)
    write_compare(args.out, meta, systems, problems)
    print((args.out / "compare.md").read_text())
    return 0 if not problems else 1


def _make_checkpoint() -> Path:
    from ferry.model.make_model import make_model

    return make_model(Path(tempfile.mkdtemp(prefix="ferry-compare-")) / "bench-llama", "llama", "bench")


def _stage(stages: dict, label: str, fn) -> object:
    """Run one stage, recording the load average when it started and its wall time."""
    started, load = time.monotonic(), [round(x, 2) for x in os.getloadavg()]
    try:
        return fn()
    finally:
        stages[label] = {"load_1_5_15_min_at_start": load, "wall_s": round(time.monotonic() - started, 1)}


def run_engines(args, chosen, model_dir, workload, systems, problems, stages) -> list:
    """The in-process engines all at once, then the Poisson rate, then the engines at that rate;
    -> the phase plans every HTTP system runs too."""
    names = [n for n in engines.ENGINE_SYSTEMS if n in chosen]
    plans = make_plans([math.inf], workload.num_requests, workload.seed)
    lm, requests = engines.load(model_dir, args.threads, workload) if names else (None, None)

    def run(plan):
        for name, summary in engines.run_engine_phase(
            lm, names, requests, plan, args.max_num_seqs, args.num_kv_blocks, problems
        ).items():
            systems.setdefault(name, {})[plan.name] = summary

    if names:
        _stage(stages, f"engines, {plans[0].name}", lambda: run(plans[0]))
    rate = poisson_rate(args, systems, problems)
    if rate is not None:
        plans += make_plans([rate], workload.num_requests, workload.seed)
        if names:
            _stage(stages, f"engines, {plans[1].name}", lambda: run(plans[1]))
    return plans


def poisson_rate(args, systems, problems) -> float | None:
    """--rate, else --rate-fraction x --rate-base's all-at-once req/s; None = no Poisson phase."""
    if args.rate is not None:
        return args.rate
    if args.rate_fraction <= 0:
        return None
    try:
        return ratios.poisson_rate(systems, args.rate_base, args.rate_fraction)
    except ValueError as exc:
        problems["poisson phase"] = f"skipped: {exc} (choose it in --systems, or pass --rate)"
        return None


def run_http_system(name, args, model_dir, workload, plans, systems, problems) -> None:
    """Start the server, wait until it answers, warm it up, run every phase, stop it."""
    run_dir = Path(tempfile.mkdtemp(prefix=f"ferry-compare-{name}-"))  # server logs: their tails go into problems
    if name == "ferry-up":
        server = servers.start_ferry_up(
            model_dir, run_dir, ["--max-running", str(args.max_num_seqs), "--num-kv-blocks", str(args.num_kv_blocks)]
        )
        marker, length_control = "ferry up: ready", "extra"
    else:
        server = servers.start_hf_serve(model_dir, run_dir, [])
        marker, length_control = None, "hf-generation-config"
    try:
        problem = servers.wait_ready(server, args.ready_timeout, log_marker=marker)
        if problem:
            problems[name] = problem
            return
        config = OnlineConfig(
            base_url=server.base_url,
            model=detect_model(server.base_url),
            length_control=length_control,
            phase_time_limit_s=args.phase_time_limit,
            request_timeout_s=args.phase_time_limit,
            max_concurrency=max(64, workload.num_requests),
        )
        problem = _warm_up(config)
        if problem:
            problems[name] = f"warm-up failed: {problem}\n{server.log_tail()}"
            return
        rates = [plan.rate_rps for plan in plans]
        report = bench_url(
            config, workload, rates, "text", str(args.out / name / "bench"), meta={"system": name}, plots=False
        )
        systems[name] = {s["name"]: s for s in report["summary"]}
        errors = [e for s in report["summary"] for e in s["errors"]]
        if errors:
            problems[name] = f"some requests failed: {errors[:3]}"
    except Exception as exc:  # one broken system must not lose the others' numbers
        problems[name] = f"{type(exc).__name__}: {exc}\n{server.log_tail()}"
    finally:
        servers.stop(server)


def _warm_up(config: OnlineConfig) -> str:
    """Two short requests before measuring (first-request setup is not what we compare)."""
    calls = [
        CompletionCall(index=i, prompt="the ferry river boat harbor dock", max_tokens=4, num_prompt_tokens=7)
        for i in range(2)
    ]
    phase = asyncio.run(run_phase(calls, [0.0, 0.0], config, "warm-up", math.inf))
    bad = [r.error or "failed" for r in phase.results if not r.ok]
    return bad[0] if bad else ""


def _meta(args, model_dir, workload, plans, stages) -> dict:
    import torch
    import transformers

    rate = plans[1].rate_rps if len(plans) > 1 else None
    how = (
        f"--rate {args.rate}"
        if args.rate is not None
        else f"{args.rate_fraction} x {args.rate_base}'s all-at-once req/s"
    )
    return {
        "date_utc": time.strftime("%Y-%m-%d %H:%M:%SZ", time.gmtime()),
        "checkpoint": str(model_dir),
        "workload": f"{workload.num_requests} requests, seed {workload.seed}, prompt median "
        f"{workload.prompt_len_median}, outputs {list(workload.output_lens)}",
        "phases": ", ".join(p.name for p in plans)
        + (
            f" (Poisson rate: {how}; the {workload.num_requests} "
            f"sampled arrivals come at {_realized_rps(plans[1]):.3g} "
            "req/s)"
            if rate
            else ""
        ),
        "engine batch cap": args.max_num_seqs,
        "threads per model process": args.threads,
        "cpu cores": os.cpu_count(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "stages (load average at start, wall seconds)": json.dumps(stages),
    }


def _realized_rps(plan) -> float:
    """The arrival rate the sampled Poisson schedule really has (a few dozen samples stray from nominal)."""
    arrivals = plan.arrivals_s
    return (len(arrivals) - 1) / arrivals[-1] if len(arrivals) > 1 and arrivals[-1] > 0 else math.inf


def write_compare(out: Path, meta: dict, systems: dict, problems: dict) -> None:
    pairs, target_rows = ratios.ratios(systems), ratios.targets(systems)
    doc = {
        "meta": meta,
        "targets": target_rows,
        "ratios": pairs,
        "poisson_load": ratios.poisson_loads(systems),
        "systems": systems,
        "problems": problems,
    }
    (out / "compare.json").write_text(json.dumps(doc, indent=1))
    render.plot(out / "compare.png", systems)
    (out / "compare.md").write_text(
        render.markdown(meta, systems, problems, pairs, target_rows) + "\n![capacity and latency](compare.png)\n"
    )


if __name__ == "__main__":
    sys.exit(main())
