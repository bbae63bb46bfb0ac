"""A group's collective backend follows the engine's device, not the machine: CPU ranks on a GPU
machine use gloo (NCCL would put every rank on the one card and refuse: 'Duplicate GPU detected')."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from ferry.parallel.lockstep import GroupAddress, init_group

pytestmark = pytest.mark.unit


def test_cpu_ranks_use_gloo_even_when_a_gpu_is_there(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # a GPU machine, as the ranks would see it
    group = init_group(GroupAddress.free_local(), 0, 1, "cpu", timeout_s=20)
    try:
        assert dist.get_backend(group) == "gloo"
    finally:
        dist.destroy_process_group()
