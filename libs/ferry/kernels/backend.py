"""Which attention implementation a model runs, decided once when the engine (or load_model) is built
and handed to every attention layer, never read from the environment in the forward pass.

- 'triton': the Triton kernels (CUDA; on the CPU only under TRITON_INTERPRET=1, as the tests run them);
- 'cpu': plain torch plus the C++ CPU kernels (cpu_decode.py, cpu_layers.py, packed weights) where built;
- 'torch': plain torch only (attention_ref.py), for any device: FERRY_ATTENTION=torch on a GPU lands
  here, never in the CPU-only C++ kernel; so does a CPU with FERRY_CPU_KERNELS=0.
The model hands the backend to every module that picks a kernel (CausalLM.set_attention_backend), so
neither variable is read in the forward pass.
"""

from __future__ import annotations

import os

import torch

from ferry.engine.config import ATTENTION_CHOICES  # torch-free: ferry.engine imports only its config
from ferry.kernels.cpu_decode import cpu_kernels_enabled

ATTENTION_BACKENDS = ("triton", "cpu", "torch")


def resolve_attention(device: torch.device | str, choice: str | None = None) -> str:
    """-> one of ATTENTION_BACKENDS for a model on device. choice: 'auto' (Triton on CUDA, else the CPU
    path), 'torch' or 'triton'; None reads FERRY_ATTENTION (default auto). On the CPU, FERRY_CPU_KERNELS=0
    means 'torch' (no C++ kernel anywhere)."""
    choice = choice or os.environ.get("FERRY_ATTENTION", "auto")
    if choice not in ATTENTION_CHOICES:
        raise ValueError(f"FERRY_ATTENTION={choice!r}: expected one of {ATTENTION_CHOICES}")
    kind = torch.device(device).type
    if choice == "triton" or (choice == "auto" and kind == "cuda"):
        return "triton"
    return "cpu" if kind == "cpu" and cpu_kernels_enabled() else "torch"
