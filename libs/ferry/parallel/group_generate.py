"""`ferry generate --ep-size N`: N spawned rank processes hold one model between them; the prompts
are dealt out round-robin (attention data-parallel), the ranks step in lockstep, rank 0 gathers
every result in prompt order."""

from __future__ import annotations

from pathlib import Path

import torch.distributed as dist
import torch.multiprocessing as mp

from ferry.engine.config import EngineConfig
from ferry.parallel.lockstep import GroupAddress, LockstepEngine, init_group, load_rank_engine, split_round_robin
from ferry.parallel.placement import ExpertPlacement


def generate_on_group(
    model: str | Path,
    prompts: list,
    sampling,
    config: EngineConfig,
    ep_size: int,
    placement: ExpertPlacement | None = None,
) -> list[dict]:
    """Runs every prompt on an ep_size-rank group; -> one result dict per prompt, like generate().
    placement: which rank holds which experts (default: contiguous, no copies)."""
    ctx = mp.get_context("spawn")
    results = ctx.SimpleQueue()
    address = GroupAddress.free_local()
    args = (ep_size, address, str(model), prompts, sampling, config, placement, results)
    mp.spawn(_rank_main, args=args, nprocs=ep_size)
    return results.get()


def _rank_main(rank, ep_size, address, model, prompts, sampling, config, placement, results) -> None:
    import torch

    from ferry.engine.generate_cli import generate

    torch.set_num_threads(1)  # the group's ranks share the machine's cores
    group = init_group(address, rank, ep_size)
    engine = LockstepEngine(load_rank_engine(model, config, rank, ep_size, placement), group)
    mine = split_round_robin(prompts, rank, ep_size)
    local = generate(engine, [prompts[i] for i in mine], sampling)
    gathered = [None] * ep_size if rank == 0 else None
    dist.gather_object(list(zip(mine, local)), gathered, dst=0, group=group)
    if rank == 0:
        ordered = [None] * len(prompts)
        for part in gathered:
            for index, result in part:
                ordered[index] = result
        results.put(ordered)
    dist.destroy_process_group()
