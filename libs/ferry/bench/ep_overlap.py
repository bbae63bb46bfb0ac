"""Dual micro-batch overlap benchmark: step time of an expert-parallel group with each step run as
one batch, as two micro-batches one after the other, and as two micro-batches overlapped; and the
fraction of the all-to-all time the overlap hides.

    python ops/bench/ep/overlap.py --out ops/bench/ep/reports/<name>            # CPU, gloo
    python ops/bench/ep/overlap.py --device cuda --out ...                      # GPU, NCCL

Spawns --ranks rank processes holding a random `bench`-size DeepSeek-V3 (MLA + 16 routed experts).
Prefill: each rank prefills --prefill-seqs prompts of --prefill-len tokens in one step. Decode:
each rank decodes --decode-seqs sequences. The modes take turns (--rounds rounds of --steps steps
each), all in one run. Communication time is the time a rank is blocked in its collectives: wait()
on the all-to-alls and the step's all-gather of token counts (host-blocking on gloo); hidden =
1 - blocked(overlap) / blocked(sequential), over the run and per round. A rank whose experts got
fewer tokens also waits, for the busier one, in its collectives: the expert load's max/mean over
the ranks is reported beside, and so is the exposed communication: per collective, the wait of
the rank that waited least (the last to arrive waits for the transfer only, not for a late peer),
summed over the step's collectives; --eplb N first places the experts by EPLB from N prefill steps'
routing (one spare slot per rank for copies). --pin 1 pins each rank process to its own core,
with gloo's threads (the report's params say which cores each rank ran on); the default 0 leaves
them free: on 2 cores pinning made steps 5-10% faster but hid less (ops/bench/ep/README.md).
Writes overlap.json (summary, per-step raw samples) and overlap.png.
On CUDA (NCCL, one GPU per rank, so >= 2 GPUs: ops/bench/ep/overlap_gpu.sh) wait() only orders
streams and does not block the host: steps are timed with a device synchronize and only step
times and their ratios are reported; the hidden fractions are null there.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ferry.bench.plots import pyplot, save_figure
from ferry.engine.config import EngineConfig
from ferry.model.make_model import make_model
from ferry.parallel.eplb import EplbConfig
from ferry.parallel.lockstep import GroupAddress, init_group, leave_group, load_rank_engine
from ferry.parallel.overlap import MODES
from ferry.parallel.rebalance import Rebalancer
from ferry.parallel.shard import expert_parallel_layers
from ferry.protocol import SamplingParams


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _timed_step(engine, layers, device: str) -> tuple[float, float, dict[str, float], int, list[float]]:
    """-> (step seconds, seconds blocked in collectives: the layers' all-to-alls and the runner's
    all-gather of token counts, those seconds by collective, (token, expert) rows this rank's
    experts computed, the seconds of every wait in the order every rank waits), after a barrier
    aligns the ranks."""
    dist.barrier()
    for waiter in [*layers, engine.runner]:
        waiter.comm_wait_s = 0.0
    for layer in layers:
        layer.comm_wait_by_kind, layer.comm_waits, layer.computed_tokens = {}, [], 0
    start = time.perf_counter()
    engine.step()
    _sync(device)
    elapsed = time.perf_counter() - start
    by_kind = {"all_gather": engine.runner.comm_wait_s}
    for layer in layers:
        for kind, waited in layer.comm_wait_by_kind.items():
            by_kind[kind] = by_kind.get(kind, 0.0) + waited
    blocked = sum(waiter.comm_wait_s for waiter in [*layers, engine.runner])
    waits = [engine.runner.comm_wait_s] + [waited for layer in layers for waited in layer.comm_waits or []]
    return elapsed, blocked, by_kind, sum(layer.computed_tokens for layer in layers), waits


def _prompts(rank: int, count: int, length: int, salt: int) -> list[list[int]]:
    return [[(97 * (salt + i) + 31 * j + rank) % 1900 + 50 for j in range(length)] for i in range(count)]


def _prefill_step(engine, rank: int, args, salt: int) -> None:
    sampling = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    for i, ids in enumerate(_prompts(rank, args.prefill_seqs, args.prefill_len, salt * 1000)):
        engine.add_request(f"p{salt}-{i}", ids, sampling)


def _balance_experts(engine, rank: int, args) -> None:
    """--eplb N: N prefill steps (prompts the measured steps do not use) whose routing EPLB places
    the experts from, copies of hot ones in each rank's spare slot."""
    config = EplbConfig(every_steps=args.eplb, window_steps=args.eplb, redundant_slots_per_rank=1)
    rebalancer = Rebalancer(engine.lm, rank, config)
    engine.runner.mode = "single"
    for step in range(args.eplb):
        _prefill_step(engine, rank, args, -1 - step)
        dist.barrier()
        engine.step()
        rebalancer.after_step()
    assert rebalancer.num_rebalances == 1


def _measure_prefill(engine, layers, args, rank) -> dict[str, list]:
    samples: dict[str, list] = {mode: [] for mode in MODES}
    for round_ in range(args.rounds):
        for mode in MODES:
            engine.runner.mode = mode
            for step in range(args.steps):
                _prefill_step(engine, rank, args, (round_ * len(MODES) + MODES.index(mode)) * args.steps + step)
                samples[mode].append(_timed_step(engine, layers, args.device))
                assert not engine.has_unfinished_requests()
    return samples


def _measure_decode(engine, layers, args, rank) -> dict[str, list]:
    total_steps = args.rounds * len(MODES) * args.steps + 4
    sampling = SamplingParams(max_tokens=total_steps + 8, temperature=0.0, ignore_eos=True)
    for i, ids in enumerate(_prompts(rank, args.decode_seqs, args.decode_context, 7)):
        engine.add_request(f"d{i}", ids, sampling)
    engine.runner.mode = "single"
    while engine.stats().num_waiting or any(s.num_computed_tokens < s.num_tokens - 1 for s in engine.scheduler.running):
        dist.barrier()
        engine.step()  # prefill everything first
    samples: dict[str, list] = {mode: [] for mode in MODES}
    for _ in range(args.rounds):
        for mode in MODES:
            engine.runner.mode = mode
            for _ in range(args.steps):
                samples[mode].append(_timed_step(engine, layers, args.device))
    return samples


def _pin(rank: int, args: argparse.Namespace) -> list[int]:
    """--pin 1: this rank process on its own core (rank i on the i-th core it may use, cycling when
    there are more ranks than cores), before the group starts, so gloo's threads, created at init,
    inherit it and run on the rank's core instead of the other rank's; -> the cores it runs on."""
    if args.pin:
        cores = sorted(os.sched_getaffinity(0))
        os.sched_setaffinity(0, {cores[rank % len(cores)]})
    return sorted(os.sched_getaffinity(0))


def _rank_main(rank: int, args: argparse.Namespace, address: GroupAddress, model: str, queue) -> None:
    cores = _pin(rank, args)
    torch.set_num_threads(args.torch_threads)
    init_group(address, rank, args.ranks, args.device)
    config = EngineConfig(
        num_kv_blocks=args.kv_blocks,
        block_size=16,
        max_num_seqs=max(args.decode_seqs, args.prefill_seqs),
        max_num_batched_tokens=max(args.prefill_seqs * args.prefill_len, args.decode_seqs),
        enable_prefix_caching=False,
        device=args.device,
        detokenize=False,
    )
    eplb = EplbConfig(redundant_slots_per_rank=1) if args.eplb else None
    engine = load_rank_engine(model, config, rank, args.ranks, eplb=eplb)
    if args.eplb:
        _balance_experts(engine, rank, args)
    layers = [layer for _, layer in expert_parallel_layers(engine.lm)]
    result = {
        "cores": cores,
        "prefill": _measure_prefill(engine, layers, args, rank),
        "decode": _measure_decode(engine, layers, args, rank),
    }
    gathered = [None] * args.ranks if rank == 0 else None
    dist.gather_object(result, gathered, dst=0)
    if rank == 0:
        queue.put(gathered)
    leave_group()


def _stats(per_rank: list[dict], phase: str, mode: str, steps: slice) -> dict:
    """Median over steps of the slowest rank's step time, of the ranks' mean blocked time (in all
    and by collective) and of the ranks' expert load imbalance (max / mean rows computed)."""
    rows = list(zip(*(rank[phase][mode][steps] for rank in per_rank)))  # per step: a sample per rank
    kinds = sorted({kind for row in rows for sample in row for kind in sample[2]})

    def median(value) -> float:
        return statistics.median(value(row) for row in rows)

    return {
        "step_ms": 1000 * median(lambda row: max(sample[0] for sample in row)),
        "comm_blocked_ms": 1000 * median(lambda row: statistics.mean(sample[1] for sample in row)),
        "comm_blocked_ms_by_collective": {
            kind: 1000 * median(lambda row, kind=kind: statistics.mean(sample[2].get(kind, 0.0) for sample in row))
            for kind in kinds
        },
        "exposed_comm_ms": 1000 * median(lambda row: sum(map(min, zip(*(sample[4] for sample in row))))),
        "expert_rows_max_over_mean": median(
            lambda row: max(sample[3] for sample in row) / max(statistics.mean(sample[3] for sample in row), 1)
        ),
    }


def _hidden(modes: dict, measure: str = "comm_blocked_ms") -> float:
    return 1 - modes["overlap"][measure] / modes["sequential"][measure]


def summarise(per_rank: list[dict], device: str, steps_per_round: int) -> dict:
    """Per phase and mode: the _stats of every step; hidden fractions against the sequential mode,
    over the whole run and per round (the modes take turns, so each round compares them afresh)."""
    out = {}
    host_blocks = not device.startswith("cuda")
    for phase in ("prefill", "decode"):
        modes: dict = {mode: _stats(per_rank, phase, mode, slice(None)) for mode in MODES}
        seq, ovl = modes["sequential"], modes["overlap"]
        modes["hidden_fraction"] = _hidden(modes) if host_blocks else None
        num_rounds = len(per_rank[0][phase]["single"]) // steps_per_round
        rounds = [slice(r * steps_per_round, (r + 1) * steps_per_round) for r in range(num_rounds)]
        modes["hidden_fraction_per_round"] = (
            [_hidden({mode: _stats(per_rank, phase, mode, r) for mode in MODES}) for r in rounds]
            if host_blocks
            else None
        )
        modes["exposed_comm_hidden_fraction"] = _hidden(modes, "exposed_comm_ms") if host_blocks else None
        modes["exposed_comm_hidden_fraction_per_round"] = (
            [_hidden({mode: _stats(per_rank, phase, mode, r) for mode in MODES}, "exposed_comm_ms") for r in rounds]
            if host_blocks
            else None
        )
        modes["hidden_fraction_by_step_time"] = (
            (seq["step_ms"] - ovl["step_ms"]) / seq["comm_blocked_ms"] if host_blocks else None
        )
        modes["speedup_overlap_vs_single"] = modes["single"]["step_ms"] / ovl["step_ms"]
        modes["speedup_overlap_vs_sequential"] = seq["step_ms"] / ovl["step_ms"]
        out[phase] = modes
    return out


def plot(report: dict, path: Path) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, phase in zip(axes, ("prefill", "decode")):
        data = report["result"][phase]
        compute = [data[m]["step_ms"] - data[m]["comm_blocked_ms"] for m in MODES]
        blocked = [data[m]["comm_blocked_ms"] for m in MODES]
        ax.bar(MODES, compute, label="compute + other", color="#48c")
        ax.bar(MODES, blocked, bottom=compute, label="blocked in collectives", color="#c44")
        ax.set_ylabel("step time (ms, median, slowest rank)")
        hidden = data["hidden_fraction"]
        ax.set_title(f"{phase}: {hidden:.0%} of blocked time hidden" if hidden is not None else phase)
    axes[0].legend()
    fig.suptitle(f"{report['params']['ranks']} ranks, {report['params']['device']}")
    save_figure(fig, path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--device", default="cpu")
    for name, default in dict(
        ranks=2, prefill_seqs=4, prefill_len=128, decode_seqs=32, decode_context=64, rounds=4, steps=5,
        kv_blocks=256, torch_threads=1, eplb=0, pin=0,
    ).items():  # fmt: skip
        parser.add_argument(f"--{name.replace('_', '-')}", type=int, default=default)
    args = parser.parse_args()
    model = make_model(Path(tempfile.mkdtemp(prefix="ferry-ep-bench")) / "ds", "deepseek-v3", "bench")
    queue = mp.get_context("spawn").SimpleQueue()
    mp.spawn(_rank_main, args=(args, GroupAddress.free_local(), str(model), queue), nprocs=args.ranks)
    per_rank = queue.get()
    result = summarise(per_rank, args.device, args.steps)
    cores = {rank: data.pop("cores") for rank, data in enumerate(per_rank)}
    report = {"params": vars(args) | {"out": str(args.out), "cores_per_rank": cores}, "result": result, "raw": per_rank}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "overlap.json").write_text(json.dumps(report, indent=2))
    plot(report, args.out / "overlap.png")
    print(json.dumps(report["result"], indent=2))


if __name__ == "__main__":
    main()
