"""Which attention implementation a model runs, decided once when the engine (or load_model) is built
and handed to every attention layer, never read from the environment in the forward pass.

- 'triton': the Triton kernels (CUDA; on the CPU only under TRITON_INTERPRET=1, as the tests run them);
- 'cpu': plain torch plus the fused C++ CPU kernels (cpu_decode.py) where they are built and switched on;
- 'torch': plain torch only (attention_ref.py), for any device: FERRY_ATTENTION=torch on a GPU lands
  here, never in the CPU-only C++ kernel.
"""

from __future__ import annotations

import os

import torch

from ferry.engine.config import ATTENTION_CHOICES  # torch-free: ferry.engine imports only its config

ATTENTION_BACKENDS = ("triton", "cpu", "torch")


def resolve_attention(device: torch.device | str, choice: str | None = None) -> str:
    """-> one of ATTENTION_BACKENDS for a model on device. choice: 'auto' (Triton on CUDA, else the CPU
    path), 'torch' or 'triton'; None reads FERRY_ATTENTION (default auto)."""
    choice = choice or os.environ.get("FERRY_ATTENTION", "auto")
    if choice not in ATTENTION_CHOICES:
        raise ValueError(f"FERRY_ATTENTION={choice!r}: expected one of {ATTENTION_CHOICES}")
    kind = torch.device(device).type
    if choice == "triton" or (choice == "auto" and kind == "cuda"):
        return "triton"
    return "cpu" if kind == "cpu" else "torch"
