"""One comparison run: the same random `bench` checkpoint and the same seeded workload through

  engine-static   ferry's engine in-process, static batching (ferry.bench.offline.run_engine)
  engine-dynamic  ferry's engine in-process, continuous batching
  ferry-up        the whole system (`ferry up`: gateway, balancers, workers over NATS, KV via Redis)
  hf-serve        `transformers serve <folder> --continuous-batching` on CPU, offline

one after another in this one invocation, each on an otherwise idle server, then writes
compare.json, compare.md (figures + ratios) and compare_throughput.png, plus each HTTP system's own
`ferry bench --url` report in a subfolder. Phases: all requests at once, then Poisson arrivals at
`--rate-fraction` x engine-static's measured all-at-once requests/s (the same rate for everyone).

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

sys.path.insert(0, str(Path(__file__).resolve().parent))

import ratios  # noqa: E402
import servers  # noqa: E402

from ferry.bench.http_client import CompletionCall  # noqa: E402
from ferry.bench.online import OnlineConfig, PhasePlan, bench_url, detect_model, make_plans, run_phase  # noqa: E402
from ferry.bench.workload import WorkloadConfig, make_workload  # noqa: E402

SYSTEMS = ("engine-static", "engine-dynamic", "ferry-up", "hf-serve")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True, help="report folder")
    p.add_argument("--model", type=Path, help="checkpoint folder (default: a fresh `ferry make-model --size bench`)")
    p.add_argument("--systems", default=",".join(SYSTEMS), help="default %(default)s")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output-lens", default="16,32,64,128,128,256")
    p.add_argument("--rate-fraction", type=float, default=0.5,
                   help="Poisson rate as a fraction of engine-static's all-at-once req/s; 0 = no Poisson phase")
    p.add_argument("--max-num-seqs", type=int, default=32, help="batch cap of ferry's engine and workers")
    p.add_argument("--num-kv-blocks", type=int, default=4096)
    p.add_argument("--threads", type=int, default=1,
                   help="torch/OpenMP threads of every model process (in-process engine, ferry workers, "
                        "transformers serve). Default 1: on a busy 2-core box, 2 spinning OpenMP threads made "
                        "one engine step ~85x slower")
    p.add_argument("--ready-timeout", type=float, default=300.0)
    p.add_argument("--phase-time-limit", type=float, default=1800.0)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    chosen = [s.strip() for s in args.systems.split(",") if s.strip()]
    if set(chosen) - set(SYSTEMS):
        raise SystemExit(f"--systems: choose from {SYSTEMS}")
    args.out.mkdir(parents=True, exist_ok=True)
    os.environ["OMP_NUM_THREADS"] = str(args.threads)  # inherited by every server process started below
    model_dir = args.model or _make_checkpoint()
    workload = WorkloadConfig(num_requests=args.num_requests, seed=args.seed,
                              output_lens=tuple(int(x) for x in args.output_lens.split(",")),
                              vocab_size=json.loads((model_dir / "config.json").read_text())["vocab_size"])
    systems: dict[str, dict[str, dict]] = {}
    problems: dict[str, str] = {}
    loads: dict[str, list[float]] = {}
    plans = run_engines(args, chosen, model_dir, workload, systems, problems, loads)
    for name in ("ferry-up", "hf-serve"):
        if name in chosen:
            loads[name] = list(os.getloadavg())
            run_http_system(name, args, model_dir, workload, plans, systems, problems)
    meta = _meta(args, model_dir, workload, plans, loads)
    write_compare(args.out, meta, systems, problems)
    print((args.out / "compare.md").read_text())
    return 0 if not problems else 1


def _make_checkpoint() -> Path:
    from ferry.model.make_model import make_model

    return make_model(Path(tempfile.mkdtemp(prefix="ferry-compare-")) / "bench-llama", "llama", "bench")


def run_engines(args, chosen, model_dir, workload, systems, problems, loads) -> list[PhasePlan]:
    """The in-process engines, static and dynamic taking turns step by step (ferry.bench.offline's
    side_by_side: both see the same machine noise); all at once first, which sets the Poisson rate."""
    import torch

    from ferry.bench.offline import engine_turns, side_by_side
    from ferry.engine.config import EngineConfig
    from ferry.model import load_model

    engines = [name for name in ("engine-static", "engine-dynamic") if name in chosen]
    plans = make_plans([math.inf], workload.num_requests, workload.seed)
    if not engines:
        problems["poisson phase"] = "skipped: its rate is set from the in-process engine, which was not chosen"
        return plans
    torch.set_num_threads(args.threads)
    lm = load_model(str(model_dir))
    requests = make_workload(workload)

    def run(plan: PhasePlan) -> None:
        turns = {name: engine_turns(lm, EngineConfig(batching=name.split("-")[1], max_num_seqs=args.max_num_seqs,
                                                     num_kv_blocks=args.num_kv_blocks),
                                    requests, plan.arrivals_s, name) for name in engines}
        for name, result in side_by_side(turns, len(requests) * len(engines), True).items():
            systems.setdefault(name, {})[plan.name] = result.summary()

    loads["engines, all at once"] = list(os.getloadavg())
    run(plans[0])
    if args.rate_fraction > 0:
        rps = systems[engines[0]][plans[0].name]["requests_per_s"]  # static's capacity when it ran
        plans += make_plans([round(args.rate_fraction * rps, 4)], workload.num_requests, workload.seed)
        loads["engines, poisson"] = list(os.getloadavg())
        run(plans[1])
    return plans


def run_http_system(name, args, model_dir, workload, plans, systems, problems) -> None:
    """Start the server, wait until it answers, warm it up, run every phase, stop it."""
    run_dir = args.out / name
    run_dir.mkdir(parents=True, exist_ok=True)
    if name == "ferry-up":
        server = servers.start_ferry_up(model_dir, run_dir, ["--max-running", str(args.max_num_seqs),
                                                             "--num-kv-blocks", str(args.num_kv_blocks)])
        marker, length_control = "ferry up: ready", "extra"
    else:
        server = servers.start_hf_serve(model_dir, run_dir, [])
        marker, length_control = None, "hf-generation-config"
    try:
        problem = servers.wait_ready(server, args.ready_timeout, log_marker=marker)
        if problem:
            problems[name] = problem
            return
        config = OnlineConfig(base_url=server.base_url, model=detect_model(server.base_url),
                              length_control=length_control, phase_time_limit_s=args.phase_time_limit,
                              request_timeout_s=args.phase_time_limit, max_concurrency=max(64, workload.num_requests))
        problem = _warm_up(config)
        if problem:
            problems[name] = f"warm-up failed: {problem}\n{server.log_tail()}"
            return
        rates = [plan.rate_rps for plan in plans]
        report = bench_url(config, workload, rates, "text", str(run_dir / "bench"), meta={"system": name})
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
    calls = [CompletionCall(index=i, prompt="the ferry river boat harbor dock", max_tokens=4,
                            num_prompt_tokens=7) for i in range(2)]
    phase = asyncio.run(run_phase(calls, [0.0, 0.0], config, "warm-up", math.inf))
    bad = [r.error for r in phase.results if not r.ok]
    return bad[0] if bad else ""


def _meta(args, model_dir, workload, plans, loads) -> dict:
    import torch
    import transformers

    return {"date_utc": time.strftime("%Y-%m-%d %H:%M:%SZ", time.gmtime()), "checkpoint": str(model_dir),
            "workload": f"{workload.num_requests} requests, seed {workload.seed}, prompt median "
                        f"{workload.prompt_len_median}, outputs {list(workload.output_lens)}",
            "phases": ", ".join(f"{p.name}" for p in plans) + (
                f" (Poisson rate = {args.rate_fraction} x the first in-process engine's all-at-once req/s)"
                if len(plans) > 1 else ""),
            "clocks": "in-process engines: their own step time plus idle gaps (ferry.bench.offline); "
                      "HTTP systems: client wall clock, TTFT/E2E from send", "engine batch cap": args.max_num_seqs,
            "threads per model process": args.threads,
            "cpu cores": os.cpu_count(), "torch": torch.__version__, "transformers": transformers.__version__,
            "load average (1, 5, 15 min) when each system started": json.dumps(loads)}


def write_compare(out: Path, meta: dict, systems: dict, problems: dict) -> None:
    pairs = ratios.ratios(systems)
    doc = {"meta": meta, "systems": systems, "ratios": pairs, "problems": problems}
    (out / "compare.json").write_text(json.dumps(doc, indent=1))
    ratios.plot(out / "compare_throughput.png", systems)
    (out / "compare.md").write_text(ratios.markdown(meta, systems, problems, pairs)
                                    + "\n![throughput](compare_throughput.png)\n")


if __name__ == "__main__":
    sys.exit(main())
