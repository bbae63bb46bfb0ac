"""Host time of a decode step at small batch (issue #22): per-step wall time of LLMEngine.step() on pure-decode
steps of B sequences, split into the runner's input building (runner.prepare), the model forward, sampling and
the rest (scheduler, outputs), and with --profile torch.profiler's view of the forward: the time inside the C++
kernels (ferry_cpu:: ops: matmuls, attention, fused norms, ...) against everything else (torch dispatch of the
small ops, tensor allocation, Python in the layer loop).

    /work/tools/cpu-bench python ops/bench/throughput/step_host.py smollm2 --batches 1 4 8 --profile
    # A/B of two checkouts in one call, alternating (PYTHONPATH picks the checkout):
    ... step_host.py smollm2 --ab OLD_LIBS NEW_LIBS --rounds 3 --json out.json

Each batch: B requests with 128-token prompts (seeded), ignore_eos; after their prefill, `--warm` decode steps
then `--steps` timed ones (median reported). 1 torch thread, as `ferry up`'s worker on 2 cores runs decode
beside the other services (FERRY_STEP_HOST_THREADS overrides).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

SECTIONS = ("prepare", "forward", "sample")


def timed(fn, bucket: list[float]):
    def wrapper(*args, **kwargs):
        started = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            bucket.append((time.perf_counter() - started) * 1000)

    return wrapper


def measure(model: str, batches: list[int], steps: int, warm: int, profile: bool) -> dict:
    import torch

    torch.set_num_threads(int(os.environ.get("FERRY_STEP_HOST_THREADS", "1")))
    import ferry
    from ferry.engine import EngineConfig, LLMEngine
    from ferry.engine import llm_engine as engine_module
    from ferry.model.source import resolve_model
    from ferry.protocol import SamplingParams

    engine = LLMEngine.from_model_path(str(resolve_model(model)), EngineConfig(max_num_seqs=64, num_kv_blocks=1024))
    buckets: dict[str, list[float]] = {name: [] for name in SECTIONS}
    runner = engine.runner
    runner.prepare = timed(runner.prepare, buckets["prepare"])  # type: ignore[method-assign]
    lm = runner.lm.model
    forward = lm.forward
    lm.forward = timed(forward, buckets["forward"])  # type: ignore[method-assign]
    engine_module.sample = timed(engine_module.sample, buckets["sample"])
    vocab = runner.lm.config.vocab_size
    gen = torch.Generator().manual_seed(0)
    result: dict = {"checkout": ferry.__file__, "batches": {}}
    for batch in batches:
        ids = [f"b{batch}-{i}" for i in range(batch)]
        for rid in ids:
            prompt = torch.randint(0, vocab, (128,), generator=gen).tolist()
            engine.add_request(rid, prompt, SamplingParams(max_tokens=100_000, temperature=0.0, ignore_eos=True))
        while True:  # until every prompt is prefilled
            engine.step()
            assert engine.last_step is not None
            if engine.last_step.num_prefill_tokens == 0 and engine.last_step.num_seqs == batch:
                break
        for _ in range(warm):
            engine.step()
        tokens = []
        for bucket in buckets.values():
            bucket.clear()
        walls = []
        for _ in range(steps):
            started = time.perf_counter()
            outputs = engine.step()
            walls.append((time.perf_counter() - started) * 1000)
            tokens.append([o.new_token_ids[-1] for o in outputs])
        row = {"step_ms": statistics.median(walls), "steps": steps}
        for name, bucket in buckets.items():
            row[f"{name}_ms"] = statistics.median(bucket)
        row["other_ms"] = row["step_ms"] - sum(row[f"{n}_ms"] for n in SECTIONS)
        row["tokens_head"] = tokens[:4]  # greedy: the same on every checkout that keeps outputs identical
        if profile:
            row.update(profile_forward(engine, torch, min(steps, 32)))
        result["batches"][str(batch)] = row
        for rid in ids:
            engine.abort_request(rid)
        line = " ".join(f"{k} {v:.3f}" for k, v in row.items() if isinstance(v, float))
        print(f"batch {batch}: {line}", flush=True)
    return result


def profile_forward(engine, torch, steps: int) -> dict:
    """torch.profiler over `steps` engine steps: self time of the ferry_cpu:: kernels, of every other op, and the
    profiled step's wall time; the top ops by self time (what the host spends around the kernels)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        started = time.perf_counter()
        for _ in range(steps):
            engine.step()
        wall_ms = (time.perf_counter() - started) * 1000 / steps
    kernel_us, other_us, ops = 0.0, 0.0, []
    for event in prof.key_averages():
        self_us = event.self_cpu_time_total / steps
        if event.key.startswith("ferry_cpu::") or event.key.startswith("mkldnn::"):
            kernel_us += self_us
        else:
            other_us += self_us
        ops.append((event.key, round(self_us, 1), event.count // steps))
    ops.sort(key=lambda op: -op[1])
    return {
        "profiled_step_ms": wall_ms,
        "kernel_ms": kernel_us / 1000,
        "other_ops_ms": other_us / 1000,
        "top_ops": ops[:16],
        "ops_per_step": sum(op[2] for op in ops),
    }


def run_ab(args) -> dict:
    """Alternates the checkouts (A B B A ...) in fresh processes; -> per checkout, per round, the figures."""
    out: dict = collections.defaultdict(list)
    for rnd in range(args.rounds):
        order = args.ab if rnd % 2 == 0 else args.ab[::-1]
        for libs in order:
            env = {**os.environ, "PYTHONPATH": os.pathsep.join([libs, os.environ.get("PYTHONPATH", "")])}
            cmd = [sys.executable, __file__, args.model, "--batches", *map(str, args.batches)]
            cmd += ["--steps", str(args.steps), "--warm", str(args.warm), "--child"]
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
            doc = json.loads(proc.stdout.strip().splitlines()[-1])
            print(f"round {rnd} {libs}: " + " ".join(f"B{b} {r['step_ms']:.2f}" for b, r in doc["batches"].items()))
            out[libs].append(doc)
    return dict(out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 4, 8])
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--warm", type=int, default=8)
    p.add_argument("--profile", action="store_true")
    p.add_argument("--ab", nargs=2, metavar="LIBS", help="two checkouts' libs folders, alternated")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    if args.ab:
        doc = run_ab(args)
    else:
        doc = measure(args.model, args.batches, args.steps, args.warm, args.profile)
        if args.child:
            print(json.dumps(doc))
    if args.json:
        args.json.write_text(json.dumps(doc, indent=1))


if __name__ == "__main__":
    main()
