"""Dual micro-batch overlap benchmark: step time of an expert-parallel group with each step run as
one batch, as two micro-batches one after the other, and as two micro-batches overlapped; and the
fraction of the all-to-all time the overlap hides.

    python ops/bench/ep/overlap.py --out ops/bench/ep/reports/<name>            # CPU, gloo
    python ops/bench/ep/overlap.py --device cuda --out ...                      # GPU, NCCL

Spawns --ranks rank processes holding a random `bench`-size DeepSeek-V3 (MLA + 16 routed experts).
Prefill: each rank prefills --prefill-seqs prompts of --prefill-len tokens in one step. Decode:
each rank decodes --decode-seqs sequences. After --prefill-warmup / --decode-warmup triples (not
kept), --rounds rounds of --prefill-steps / --decode-steps triples: a triple is one step of each mode
back to back, the order rotating, so the modes are compared in pairs of steps taken a second apart.
The hidden fraction of the all-to-all time (ferry.bench.ep_overlap_stats: what the all-to-alls add
to the critical rank's step, overlapped against sequential, counting compute the overlapped
transfers slowed) is given over the run and per round. --phases prefill or decode: one only.
--pin: none (the default), rank (each rank process on its own core, gloo's threads with it) or
compute (only the rank's compute thread on its own core, gloo's threads free); the report's params
say which cores every thread of each rank could run on.
Writes overlap.json (summary, per-step raw samples) and overlap.png.
On CUDA (NCCL, one GPU per rank, so >= 2 GPUs: ops/bench/ep/overlap_gpu.sh) wait() only orders
streams and does not block the host: steps are timed with a device synchronize and only step
times are reported; the hidden fractions are absent there.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ferry.bench.ep_overlap_stats import plot, summarise
from ferry.engine.config import EngineConfig
from ferry.model.make_model import make_model
from ferry.parallel.comm_threads import cpu_seconds, gloo_threads, thread_cores
from ferry.parallel.eplb import EplbConfig
from ferry.parallel.lockstep import GroupAddress, init_group, leave_group, load_rank_engine
from ferry.parallel.overlap import MODES
from ferry.parallel.rebalance import Rebalancer
from ferry.parallel.shard import expert_parallel_layers
from ferry.protocol import SamplingParams

PIN_CHOICES = ("none", "rank", "compute")


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _timed_step(engine, layers, device: str) -> dict:
    """One step of this rank, after a barrier aligns the ranks -> its sample (ep_overlap_stats):
    seconds of the step, blocked in the layers' all-to-alls (in all, by collective, and every wait in
    the order every rank waits) and in the runner's all-gather, and the (token, expert) rows this
    rank's experts computed; and the CPU seconds gloo's threads ran meanwhile (its copies)."""
    gloo = gloo_threads()
    dist.barrier()
    engine.runner.comm_wait_s = 0.0
    for layer in layers:
        layer.comm_wait_s, layer.comm_wait_by_kind, layer.comm_waits, layer.computed_tokens = 0.0, {}, [], 0
    gloo_cpu_s = cpu_seconds(gloo)
    start = time.perf_counter()
    engine.step()
    _sync(device)
    elapsed = time.perf_counter() - start
    gloo_cpu_s = cpu_seconds(gloo) - gloo_cpu_s
    by_collective: dict[str, float] = {}
    for layer in layers:
        for kind, waited in layer.comm_wait_by_kind.items():
            by_collective[kind] = by_collective.get(kind, 0.0) + waited
    return {
        "step_s": elapsed,
        "a2a_s": sum(layer.comm_wait_s for layer in layers),
        "all_gather_s": engine.runner.comm_wait_s,
        "by_collective": by_collective,
        "expert_rows": sum(layer.computed_tokens for layer in layers),
        "gloo_cpu_s": gloo_cpu_s,
        "waits": [waited for layer in layers for waited in layer.comm_waits or []],
    }


def _prompts(rank: int, count: int, length: int, salt: int, vocab: int) -> list[list[int]]:
    """Token ids in [50, 1950), or [50, vocab) for a smaller vocabulary (the `tiny` size's, in tests)."""
    span = min(1900, vocab - 50)
    return [[(97 * (salt + i) + 31 * j + rank) % span + 50 for j in range(length)] for i in range(count)]


def _add_prefill_work(engine, rank: int, args, salt: int, tag: str = "") -> None:
    sampling = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    prompts = _prompts(rank, args.prefill_seqs, args.prefill_len, salt * 1000, engine.lm.config.vocab_size)
    for i, ids in enumerate(prompts):
        engine.add_request(f"p{salt}{tag}-{i}", ids, sampling)


def _balance_experts(engine, rank: int, args) -> None:
    """--eplb N: N prefill steps (prompts the measured steps do not use) whose routing EPLB places
    the experts from, copies of hot ones in each rank's spare slot."""
    config = EplbConfig(every_steps=args.eplb, window_steps=args.eplb, redundant_slots_per_rank=1)
    rebalancer = Rebalancer(engine.lm, rank, config)
    engine.runner.mode = "single"
    for step in range(args.eplb):
        _add_prefill_work(engine, rank, args, -1 - step)
        dist.barrier()
        engine.step()
        rebalancer.after_step()
    assert rebalancer.num_rebalances == 1


def _num_triples(args, phase: str) -> int:
    return getattr(args, f"{phase}_warmup") + args.rounds * getattr(args, f"{phase}_steps")


def _in_triples(engine, layers, args, phase: str, before_step=None) -> dict[str, list]:
    """--<phase>-warmup triples not kept, then the rounds' triples: one step of each mode back to back,
    the modes' order rotating from triple to triple -> {mode: [sample, ...]} (i-th: the i-th triple)."""
    samples: dict[str, list] = {mode: [] for mode in MODES}
    warmup = getattr(args, f"{phase}_warmup")
    for triple in range(_num_triples(args, phase)):
        for mode in MODES[triple % 3 :] + MODES[: triple % 3]:
            engine.runner.mode = mode
            if before_step is not None:
                before_step(triple, mode)
            sample = _timed_step(engine, layers, args.device)
            if triple >= warmup:
                samples[mode].append(sample)
    return samples


def _measure_prefill(engine, layers, args, rank) -> dict[str, list]:
    def add_work(triple: int, mode: str) -> None:
        # the same prompts for the three modes of a triple: they compare the same work, routing included
        assert not engine.has_unfinished_requests(), "each prefill step finishes its prompts"
        _add_prefill_work(engine, rank, args, triple, f"-{mode}")

    return _in_triples(engine, layers, args, "prefill", add_work)


def _decode_max_tokens(args) -> int:
    return _num_triples(args, "decode") * len(MODES) + 8


def _measure_decode(engine, layers, args, rank) -> dict[str, list]:
    sampling = SamplingParams(max_tokens=_decode_max_tokens(args), temperature=0.0, ignore_eos=True)
    for i, ids in enumerate(_prompts(rank, args.decode_seqs, args.decode_context, 7, engine.lm.config.vocab_size)):
        engine.add_request(f"d{i}", ids, sampling)
    engine.runner.mode = "single"
    while engine.stats().num_waiting or any(s.num_computed_tokens < s.num_tokens - 1 for s in engine.scheduler.running):
        dist.barrier()
        engine.step()  # prefill everything first
    return _in_triples(engine, layers, args, "decode")


def _kv_blocks(args, block_size: int) -> int:
    """Enough for every decode sequence's whole length, or for one prefill step's prompts."""
    decode = args.decode_seqs * math.ceil((args.decode_context + _decode_max_tokens(args) + 1) / block_size)
    prefill = args.prefill_seqs * math.ceil((args.prefill_len + 2) / block_size)
    return max(decode, prefill) + 8


def _pin(rank: int, pin: str, phase: str) -> None:
    """Rank i on the i-th core it may use (cycling when there are more ranks than cores). "rank":
    the whole process, before the group starts (gloo's threads, created at init, inherit the core);
    "compute": only the calling (compute) thread, after the group started (gloo's threads stay free)."""
    if (pin, phase) in (("rank", "before_init"), ("compute", "after_init")):
        cores = sorted(os.sched_getaffinity(0))
        os.sched_setaffinity(0, {cores[rank % len(cores)]})  # pid 0: this thread (Linux)


def _rank_main(rank: int, args: argparse.Namespace, address: GroupAddress, model: str, out_file: str) -> None:
    _pin(rank, args.pin, "before_init")
    torch.set_num_threads(args.torch_threads)
    init_group(address, rank, args.ranks, args.device)
    _pin(rank, args.pin, "after_init")
    config = EngineConfig(
        num_kv_blocks=args.kv_blocks or _kv_blocks(args, 16),
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
    measure = {"prefill": _measure_prefill, "decode": _measure_decode}
    result: dict[str, object] = {"thread_cores": thread_cores()}
    for phase in args.phases:
        result[phase] = measure[phase](engine, layers, args, rank)
    gathered = [None] * args.ranks if rank == 0 else None
    dist.gather_object(result, gathered, dst=0)
    if rank == 0:  # a file, not a queue: the parent reads only after every rank exited
        Path(out_file).write_text(json.dumps(gathered))
    leave_group(exit_process=True)


def run_ranks(args: argparse.Namespace) -> list[dict]:
    """Writes the random checkpoint (~285 MB at `bench` size) to a temporary folder, runs the ranks on
    it, and deletes the folder however the run ends; -> each rank's samples."""
    with tempfile.TemporaryDirectory(prefix="ferry-ep-bench") as tmp:
        work = Path(tmp)
        model = make_model(work / "ds", "deepseek-v3", args.model_size)
        samples_file = work / "samples.json"
        address = GroupAddress.free_local()
        mp.spawn(_rank_main, args=(args, address, str(model), str(samples_file)), nprocs=args.ranks)
        return json.loads(samples_file.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--pin", choices=PIN_CHOICES, default="none")
    parser.add_argument("--model-size", default="bench", help="make_model's size of the random DeepSeek-V3")
    parser.add_argument(
        "--phases", type=lambda text: text.split(","), default=["prefill", "decode"], help="prefill,decode or one"
    )
    for name, default in dict(
        ranks=2, prefill_seqs=4, prefill_len=128, decode_seqs=32, decode_context=64, rounds=4,
        prefill_warmup=2, prefill_steps=12, decode_warmup=8, decode_steps=30, kv_blocks=0, torch_threads=1, eplb=0,
    ).items():  # fmt: skip
        parser.add_argument(f"--{name.replace('_', '-')}", type=int, default=default)
    args = parser.parse_args()
    if not args.phases or set(args.phases) - {"prefill", "decode"}:
        raise SystemExit(f"--phases: {','.join(args.phases)}, expected prefill, decode or prefill,decode")
    for name in ("rounds", "prefill_steps", "decode_steps"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')}: {getattr(args, name)}, expected >= 1")
    per_rank = run_ranks(args)
    steps = {phase: getattr(args, f"{phase}_steps") for phase in args.phases}
    result = summarise(per_rank, steps, host_blocks=not args.device.startswith("cuda"))
    threads = {rank: data.pop("thread_cores") for rank, data in enumerate(per_rank)}
    report = {"params": vars(args) | {"out": str(args.out), "thread_cores": threads}, "result": result, "raw": per_rank}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "overlap.json").write_text(json.dumps(report, indent=1))
    plot(report, args.out / "overlap.png")
    print(json.dumps(report["result"], indent=1))


if __name__ == "__main__":
    main()
