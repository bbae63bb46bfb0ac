"""A group's collective backend follows the engine's device, not the machine: CPU ranks on a GPU
machine use gloo (NCCL would put every rank on the one card and refuse: 'Duplicate GPU detected')."""

from __future__ import annotations

import gc
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ferry.parallel.comm_threads import GLOO_THREAD_NAMES, threads
from ferry.parallel.lockstep import GroupAddress, init_group, leave_group

pytestmark = pytest.mark.unit


def test_cpu_ranks_use_gloo_even_when_a_gpu_is_there(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # a GPU machine, as the ranks would see it
    group = init_group(GroupAddress.free_local(), 0, 1, "cpu", timeout_s=20)
    try:
        assert dist.get_backend(group) == "gloo"
    finally:
        dist.destroy_process_group()


def test_gloo_threads_outlive_destroy_process_group_while_the_group_is_referenced():
    # why leave_group(exit_process=True) ends a rank with os._exit: the engine's layers hold the group, so
    # gloo's worker threads would run on into the interpreter's finalization (lockstep.leave_group)
    group = init_group(GroupAddress.free_local(), 0, 1, "cpu", timeout_s=20)
    busy = torch.ones(4)
    dist.all_reduce(busy)
    dist.barrier()
    dist.destroy_process_group()
    assert any(name.startswith("pt_gloo_runloop") for name in threads().values())
    del group
    gc.collect()
    assert not any(name.startswith(GLOO_THREAD_NAMES) for name in threads().values())


def _leaving_rank(rank: int, address: GroupAddress, out_dir: str) -> None:
    group = init_group(address, rank, 2, "cpu", timeout_s=30)
    dist.all_reduce(torch.ones(4), group=group)
    leave_group(group, exit_process=True)
    Path(out_dir, f"after-{rank}").write_text("leave_group returned")  # not reached: the process has ended


@pytest.mark.slow
def test_a_rank_that_leaves_with_exit_process_ends_there_with_code_0(tmp_path):
    address = GroupAddress.free_local()
    context = mp.start_processes(_leaving_rank, args=(address, str(tmp_path)), nprocs=2, join=False)
    deadline = time.monotonic() + 120
    while not context.join(timeout=1):  # raises if a rank ended with a signal or a non-zero code
        assert time.monotonic() < deadline, "the ranks did not end"
    assert [p.exitcode for p in context.processes] == [0, 0]
    assert not list(tmp_path.glob("after-*"))
