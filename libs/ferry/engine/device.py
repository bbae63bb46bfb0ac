"""device_guard: make the engine's device the current one for the calling thread.

The worker runs the engine on its own thread (services/worker/compute.py), and a thread's current
CUDA device starts at 0. Tensors made with an explicit device land right, but Triton launches,
streams, events and CUDA graphs use the current device: on cuda:1 they would run against cuda:0.
Every engine call that touches the device enters this guard.
"""

from __future__ import annotations

import contextlib

import torch


def device_guard(device: torch.device | str) -> contextlib.AbstractContextManager:
    device = torch.device(device)
    if device.type != "cuda" or device.index is None:  # plain 'cuda' means the current device anyway
        return contextlib.nullcontext()
    return torch.cuda.device(device.index)
