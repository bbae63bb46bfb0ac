"""`ferry generate --ep-size N`: N spawned rank processes hold one model between them; the prompts
are dealt out round-robin (attention data-parallel), the ranks step in lockstep, rank 0 gathers
every result in prompt order and each rank's load."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch.distributed as dist
import torch.multiprocessing as mp
from torch.multiprocessing.spawn import ProcessException

from ferry.engine.config import EngineConfig
from ferry.parallel.eplb import EplbConfig
from ferry.parallel.lockstep import (
    GroupAddress,
    LockstepEngine,
    check_group_config,
    init_group,
    leave_group,
    load_rank_engine,
    split_round_robin,
)
from ferry.parallel.placement import ExpertPlacement
from ferry.parallel.rebalance import Rebalancer
from ferry.parallel.shard import expert_parallel_layers


@dataclass(slots=True)
class RankLoad:
    rank: int
    num_requests: int
    """Requests whose attention and KV this rank held."""
    expert_tokens: int
    """Token-expert pairs its routed experts computed, all layers."""
    num_rebalances: int
    """Times EPLB re-placed its experts."""
    num_experts_loaded: int
    """Experts it loaded from the checkpoint when a new placement gave it experts it lacked."""


@dataclass(slots=True)
class GroupRun:
    results: list[dict]
    """One result dict per prompt, in order, as generate() gives them."""
    ranks: list[RankLoad]


class GroupFailed(RuntimeError):
    """A rank of the group died or the group ran past its time: every rank has been stopped."""


class GroupHandle:
    """A started group: its ranks' pids, and its result once rank 0 has gathered it."""

    def __init__(self, context: mp.ProcessContext, results) -> None:
        self.context, self.results = context, results

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.context.processes]

    def result(self, timeout_s: float | None = None) -> GroupRun:
        """Waits for the group. A rank that dies (any signal, any exception) stops every other rank
        and raises GroupFailed naming it; so does running past timeout_s. Nothing is left running."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        run = None
        while True:
            if run is None and not self.results.empty():  # read as it comes: a big result fills the pipe
                run = self.results.get()
            try:
                if self.context.join(timeout=0.2):
                    break
            except ProcessException as exc:  # join() has already stopped the other ranks
                raise GroupFailed(f"rank {exc.error_index} failed: {exc}") from None
            if deadline is not None and time.monotonic() > deadline:
                self._stop()
                raise GroupFailed(f"the group ran past {timeout_s} s; every rank was stopped")
        return run if run is not None else self.results.get()

    def _stop(self) -> None:
        for process in self.context.processes:
            if process.is_alive():
                process.kill()
        for process in self.context.processes:
            process.join()


def start_group(
    model: str | Path,
    prompts: list,
    sampling,
    config: EngineConfig,
    ep_size: int,
    placement: ExpertPlacement | None = None,
    eplb: EplbConfig | None = None,
    mode: str = "single",
) -> GroupHandle:
    """Starts ep_size rank processes that run every prompt. placement: which rank holds which experts
    (default contiguous, no copies); eplb: re-place experts as the load shows; mode: one batch per
    step or two micro-batches (overlap.MODES)."""
    check_group_config(config, ep_size)
    ctx = mp.get_context("spawn")
    results = ctx.SimpleQueue()
    address = GroupAddress.free_local()
    args = (ep_size, address, str(model), prompts, sampling, config, placement, eplb, mode, results)
    return GroupHandle(mp.start_processes(_rank_main, args=args, nprocs=ep_size, join=False), results)


def generate_on_group(*args, timeout_s: float | None = None, **kwargs) -> GroupRun:
    """start_group(...).result(timeout_s): the group's results and per-rank load."""
    return start_group(*args, **kwargs).result(timeout_s)


def _rank_main(rank, ep_size, address, model, prompts, sampling, config, placement, eplb, mode, results) -> None:
    import torch

    from ferry.engine.generate_cli import generate

    torch.set_num_threads(1)  # the group's ranks share the machine's cores
    group = init_group(address, rank, ep_size, config.device)
    engine = load_rank_engine(model, config, rank, ep_size, placement, eplb, mode)
    rebalancer = Rebalancer(engine.lm, rank, eplb, group) if eplb else None
    mine = split_round_robin(prompts, rank, ep_size)
    local = generate(LockstepEngine(engine, group, rebalancer), [prompts[i] for i in mine], sampling)
    load = RankLoad(
        rank,
        len(mine),
        sum(layer.computed_tokens for _, layer in expert_parallel_layers(engine.lm)),
        rebalancer.num_rebalances if rebalancer else 0,
        rebalancer.num_experts_loaded if rebalancer else 0,
    )
    gathered: list[Any] | None = [None] * ep_size if rank == 0 else None
    dist.gather_object((list(zip(mine, local)), load), gathered, dst=0, group=group)
    if gathered is not None:  # rank 0
        ordered: list = [None] * len(prompts)
        for part, _ in gathered:
            for index, result in part:
                ordered[index] = result
        results.put(GroupRun(ordered, [load for _, load in gathered]))  # SimpleQueue: written now
    leave_group(group, exit_process=True)
