"""Attention ops over the paged KV cache: plain-torch references (CPU) and Triton kernels (GPU).

The model calls the torch path on CPU and the Triton kernels on CUDA tensors. FERRY_ATTENTION=torch
forces the torch path everywhere; FERRY_ATTENTION=triton forces the kernels (on CPU only together
with TRITON_INTERPRET=1, which the tests use to run the whole model through them). The Triton
modules are imported only when used, so CPU runs never compile anything.
"""

import os

import torch

from ferry.kernels.attention_ref import (
    causal_mask,
    decode_plan,
    gather_seq,
    paged_decode_attention,
    prefill_attention,
    write_kv,
)


def use_triton(t: torch.Tensor) -> bool:
    choice = os.environ.get("FERRY_ATTENTION", "auto")
    return choice == "triton" or (choice == "auto" and t.is_cuda)


__all__ = ["causal_mask", "decode_plan", "gather_seq", "paged_decode_attention", "prefill_attention", "use_triton", "write_kv"]
