"""Causal prefill attention of a whole new prompt on the CPU: the C++ kernel in csrc/prefill_attention.cpp (built
with the decode kernel, cpu_decode.py). It takes the query heads sharing a KV head as rows of one tile, so K/V are
not repeated to every query head as attention_ref.prefill_attention does for torch's SDPA, skips the causal blocks
after each query block and computes bf16 q/k/v with AVX512_BF16's VDPBF16PS where the build has it (else fp32).

Only for context_len == 0 and no sliding window, fp32 or bf16, head sizes that are multiples of 16: the caller
(dense_attention) asks prefill_usable first and runs attention_ref.prefill_attention otherwise.
"""

from __future__ import annotations

import os

import torch

from ferry.kernels.cpu_decode import kernel_built

PREFILL_ATTN_CPP = os.environ.get("FERRY_PREFILL_ATTN_CPP", "1") != "0"
"""FERRY_PREFILL_ATTN_CPP=0 runs whole prompts through attention_ref.prefill_attention (repeat_interleave + torch's
SDPA) instead of the C++ kernel. Read at import; benches flip this attribute to compare both in one process."""

_DTYPES = (torch.float32, torch.bfloat16)


def prefill_usable(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int | None) -> bool:
    """Whether prefill_attention takes these: switched on and built, CPU, no window, one supported dtype, head
    sizes multiples of 16, heads a multiple of the KV heads."""
    return (
        PREFILL_ATTN_CPP
        and window is None
        and q.device.type == "cpu"
        and q.dtype in _DTYPES
        and k.dtype == q.dtype
        and v.dtype == q.dtype
        and q.dim() == 3
        and q.shape[2] % 16 == 0
        and v.shape[-1] % 16 == 0
        and q.shape[1] % k.shape[1] == 0
        and kernel_built()
    )


def prefill_bf16_dot_built() -> bool:
    """The kernel was built with the VDPBF16PS path for bf16 q/k/v (a CPU, or FERRY_KERNEL_MARCH, with AVX512_BF16)."""
    return kernel_built() and bool(torch.ops.ferry_cpu.prefill_bf16_dot())


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """A whole prompt, causal: q [L, H, D], k [L, Hkv, D], v [L, Hkv, Dv] (any token / head strides) -> [L, H, Dv]
    in q's dtype, accumulated in fp32; what attention_ref.prefill_attention(q, k, v, 0, scale) computes."""
    if not kernel_built():
        raise RuntimeError("the CPU kernels could not be built (see the warning logged above)")
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    return torch.ops.ferry_cpu.prefill_attention(q, k, v, float(scale))
