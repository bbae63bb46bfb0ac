"""The ranks of one expert-parallel group step together.

Attention is data-parallel: each rank owns its own sequences and KV blocks and runs its own engine.
Every MoE layer of every step is an all-to-all across the group, so all ranks take the same number
of steps: a rank with nothing scheduled still steps (its layers join with no tokens), and the group
stops only when no rank has work left (an all-reduce per step).
"""

from __future__ import annotations

import os
import socket
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

import torch
import torch.distributed as dist

from ferry.engine.config import EngineConfig
from ferry.engine.llm_engine import LLMEngine
from ferry.engine.outputs import RequestOutput
from ferry.model import load_model
from ferry.model.quant_linear import QUANT_BITS
from ferry.parallel.eplb import EplbConfig
from ferry.parallel.overlap import OverlapRunner
from ferry.parallel.placement import ExpertPlacement
from ferry.parallel.rebalance import Rebalancer, initial_placement
from ferry.parallel.shard import shard_experts


@dataclass(slots=True)
class GroupAddress:
    """Where rank 0 listens for the group's rendezvous (torch.distributed's TCP store)."""

    host: str
    port: int

    @classmethod
    def free_local(cls) -> GroupAddress:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            return cls("127.0.0.1", sock.getsockname()[1])


def init_group(
    address: GroupAddress, rank: int, world_size: int, device: str, timeout_s: float = 60.0
) -> dist.ProcessGroup:
    """Joins the group (gloo when the ranks run on the CPU, NCCL when on GPUs: by the engine's device,
    not by whether the machine has a GPU; a CPU group on a one-GPU machine would otherwise put every
    rank on the same card and NCCL refuses that); -> the default group."""
    from datetime import timedelta

    backend = "nccl" if torch.device(device).type == "cuda" else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    dist.init_process_group(
        backend,
        init_method=f"tcp://{address.host}:{address.port}",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=timeout_s),
    )
    assert dist.group.WORLD is not None  # init_process_group made it
    return dist.group.WORLD


def leave_group(group: dist.ProcessGroup | None = None, exit_process: bool = False) -> None:
    """Every rank reaches this point before any tears down: rank 0 hosts the rendezvous store, and
    a rank that exits while another still talks to it aborts (gloo).

    exit_process: then end this (rank) process at once, without the interpreter's finalization.
    Why: destroy_process_group() does not stop gloo's worker threads (`pt_gloo_runloop`); they live
    as long as the ProcessGroup object, which the engine's layers still hold, so they run on into the
    interpreter's finalization. A worker releases a finished collective's work (and its tensors) a
    little after wait() has returned; a tensor whose Python object was dropped meanwhile is owned by
    the C++ side, and freeing it takes the GIL. A thread that asks for the GIL once finalization has
    begun is ended by Python with pthread_exit, whose unwinding through a C++ destructor (noexcept)
    calls std::terminate: "terminate called without an active exception", SIGABRT, and the group
    reports a failed rank although every result was delivered. Only on a loaded box does a worker
    lag that long. os._exit skips finalization (no thread ever meets a finalizing interpreter), after
    stdio is flushed; what the rank sends must already be written (SimpleQueue, files: synchronous)."""
    dist.barrier(group=group)
    dist.destroy_process_group()
    if exit_process:
        exit_now(0)


def exit_now(code: int) -> NoReturn:
    """Ends this process without the interpreter's finalization (see leave_group), stdio flushed."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # closed or gone: nothing to keep
            pass
    os._exit(code)


def check_group_config(config: EngineConfig, ep_size: int) -> None:
    """Refuses what a group cannot hold, before any rank is spawned: quantized weights (the ranks'
    expert stacks, EPLB's expert reloads and the all-to-alls carry float weights only)."""
    if config.weights_dtype in QUANT_BITS:
        raise ValueError(
            f"weights dtype {config.weights_dtype} (FERRY_WEIGHTS_DTYPE, --weights-dtype) with ep_size {ep_size} "
            "(FERRY_EP_SIZE, --ep-size): an expert-parallel group holds float weights only; use float32 or "
            "bfloat16 weights, or ep_size 1"
        )


def load_rank_engine(
    path: str | Path,
    config: EngineConfig,
    rank: int,
    ep_size: int,
    placement: ExpertPlacement | None = None,
    eplb: EplbConfig | None = None,
    mode: str = "single",
) -> LLMEngine:
    """This rank's engine: the model with only its routed experts, its own KV pool and scheduler.
    placement: default contiguous, or with eplb its initial placement (spare slots as copies);
    mode: how a step runs (overlap.MODES: one batch, or two micro-batches, overlapped or not)."""
    check_group_config(config, ep_size)
    lm = load_model(path, device=config.device, dtype=config.dtype, weights_dtype=config.weights_dtype)
    cfg = lm.config
    if placement is None:
        placement = (
            initial_placement(cfg.n_routed_experts, cfg.n_group, ep_size, eplb)
            if eplb
            else ExpertPlacement.contiguous(cfg.n_routed_experts, ep_size)
        )
    shard_experts(lm, placement, rank)
    engine = LLMEngine(lm, config)
    engine.runner = OverlapRunner.replacing(engine.runner, mode)
    return engine


class LockstepEngine:
    """An LLMEngine whose has_unfinished_requests() asks the whole group: a rank keeps stepping
    (idle) while any rank still has requests, so every rank's collectives meet. With a rebalancer,
    experts are re-placed between steps."""

    def __init__(
        self, engine: LLMEngine, group: dist.ProcessGroup | None = None, rebalancer: Rebalancer | None = None
    ) -> None:
        self.engine, self.group, self.rebalancer = engine, group, rebalancer

    def step(self) -> list[RequestOutput]:
        outputs = self.engine.step()
        if self.rebalancer is not None:
            self.rebalancer.after_step()
        return outputs

    def has_unfinished_requests(self) -> bool:
        busy = torch.tensor([int(self.engine.has_unfinished_requests())])
        dist.all_reduce(busy, op=dist.ReduceOp.MAX, group=self.group)
        return bool(busy.item())

    def __getattr__(self, name: str):  # add_request, step, tokenizer, stats: the rank's own engine
        return getattr(self.engine, name)


def split_round_robin(items: list, rank: int, world_size: int) -> list[int]:
    """Indices of the items rank takes when a batch is dealt out to the group's ranks."""
    return list(range(rank, len(items), world_size))
