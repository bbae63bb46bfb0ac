"""The small fused ops of a CPU step (csrc/cpu_layers.cpp, built with the decode kernel in cpu_decode.py):
RMSNorm (also after the residual add), SiLU-and-mul, rotary embedding in place, the K/V write into the paged
cache and the greedy pick over the vocabulary.

Each is one pass over its rows where plain torch runs a chain of ops with temporaries. They take fp32
activations on the CPU; for anything else (CUDA, bf16 activations, no compiler) or with fused=False
(the caller's backend is not 'cpu', e.g. FERRY_CPU_KERNELS=0) each function here runs the plain-torch
reference with the same result, so callers need no other checks.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ferry.kernels import attention_ref
from ferry.kernels.cpu_decode import SUPPORTED_CACHE_DTYPES, kernel_built


def fused_ops_usable(*tensors: torch.Tensor) -> bool:
    """True when the C++ ops take these tensors: fp32 on the CPU, elements contiguous, kernels built."""
    for t in tensors:  # a loop, not all(<generator>): this runs several times per layer and step
        if t.dtype != torch.float32 or t.device.type != "cpu" or t.stride(-1) != 1:
            return False
    return kernel_built()


def _bf16_rows_usable(x: torch.Tensor) -> bool:
    return x.dtype == torch.bfloat16 and x.device.type == "cpu" and x.stride(-1) == 1 and kernel_built()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, fused: bool = True) -> torch.Tensor:
    """weight * x / sqrt(mean(x^2) + eps) over the last dimension, normalised in fp32."""
    if fused and x.dim() == 2 and fused_ops_usable(x, weight):
        return torch.ops.ferry_cpu.rms_norm(x, weight.contiguous(), float(eps))
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def add_rms_norm_(
    x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float, fused: bool = True
) -> torch.Tensor:
    """The residual add and the next norm: x += delta in place, -> rms_norm(x, weight, eps) (one pass)."""
    if fused and x.dim() == 2 and x.shape == delta.shape and fused_ops_usable(x, delta, weight):
        return torch.ops.ferry_cpu.add_rms_norm_(x, delta, weight.contiguous(), float(eps))
    x.add_(delta)
    return rms_norm(x, weight, eps, fused)


def silu_and_mul(x: torch.Tensor, fused: bool = True) -> torch.Tensor:
    """x [T, 2I] = [gate | up] -> silu(gate) * up [T, I], in x's dtype. The C++ op takes fp32 and bf16 rows
    (bf16: computed in fp32, rounded once)."""
    if fused and x.dim() == 2 and (fused_ops_usable(x) or _bf16_rows_usable(x)):
        return torch.ops.ferry_cpu.silu_and_mul(x)
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def rotary_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, fused: bool = True) -> torch.Tensor:
    """Rotary embedding of x [T, H, D] in place (halves layout, rotate_half); cos/sin [T, D/2]. -> x"""
    if fused and x.dim() == 3 and fused_ops_usable(x, cos, sin):
        torch.ops.ferry_cpu.rotary_(x, cos.contiguous(), sin.contiguous())
        return x
    x1, x2 = x.chunk(2, dim=-1)
    c, s = cos[:, None, :], sin[:, None, :]
    x.copy_(torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1))
    return x


def write_kv(cache: torch.Tensor, slot_mapping: torch.Tensor, values: torch.Tensor, fused: bool = True) -> None:
    """cache [N, bs, H, D] slot rows slot_mapping [T] = values [T, H, D] (converted to the cache's dtype)."""
    if (
        fused
        and values.dim() == 3
        and cache.device.type == "cpu"
        and cache.stride(-1) == 1
        and cache.dtype in SUPPORTED_CACHE_DTYPES
        and fused_ops_usable(values)
    ):
        torch.ops.ferry_cpu.write_kv(cache, slot_mapping.contiguous(), values)
        return
    attention_ref.write_kv(cache, slot_mapping, values)


def argmax_rows(x: torch.Tensor, fused: bool = True) -> torch.Tensor:
    """x [B, V] -> [B] int64, the first index of each row's largest value (a NaN counts as the largest),
    exactly torch.argmax(x, dim=-1); vectorised where ATen's argmax is not."""
    if fused and x.dim() == 2 and x.size(1) > 0 and fused_ops_usable(x):
        return torch.ops.ferry_cpu.argmax_rows(x)
    return x.argmax(dim=-1)
