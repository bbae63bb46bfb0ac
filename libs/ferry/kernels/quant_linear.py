"""quant_matmul: x @ W.T for a group-wise quantized W (quant_ref.QuantizedWeight), dequantized on the fly.

Which kernel runs follows the model's backend (ferry.kernels.backend, set once at load on every
QuantLinear by CausalLM.set_attention_backend): 'triton' (CUDA; on the CPU only under TRITON_INTERPRET=1)
runs triton_quant.py; 'cpu' runs the C++ kernel (csrc/quant_linear.cpp, built with the decode kernel,
cpu_decode.py) for fp32 activations when the kernels are built and FERRY_CPU_KERNELS is not 0; anything
else, and 'torch', the plain-torch reference, which dequantizes the whole weight first.
"""

from __future__ import annotations

import os

import torch

from ferry.kernels.cpu_decode import kernel, kernel_built
from ferry.kernels.quant_pack import CpuPacked, pack_for_cpu
from ferry.kernels.quant_ref import QuantizedWeight, quant_matmul_ref


def quant_matmul(
    x: torch.Tensor,
    qw: QuantizedWeight,
    bias: torch.Tensor | None = None,
    packed: CpuPacked | None = None,
    backend: str | None = None,
) -> torch.Tensor:
    """x [..., K] -> [..., N] in x's dtype (accumulated in fp32 by the kernels). packed: qw's copy for the
    CPU kernel (pack_for_cpu, made once at load; without it the CPU kernel packs on every call). backend:
    one of ATTENTION_BACKENDS; None: Triton for CUDA tensors, else 'cpu'."""
    if x.shape[-1] != qw.in_features:
        raise ValueError(f"x {tuple(x.shape)}: last dimension must be the weight's {qw.in_features} inputs")
    backend = backend or ("triton" if x.is_cuda else "cpu")
    rows = x.reshape(-1, x.shape[-1])
    if backend == "triton":
        from ferry.kernels.triton_quant import triton_quant_matmul

        return _with_bias(triton_quant_matmul(rows, qw), bias).view(*x.shape[:-1], -1)
    if backend == "cpu" and x.device.type == "cpu" and x.dtype == torch.float32 and kernel_built():
        out = cpu_quant_matmul(rows, packed or pack_for_cpu(qw))
        return _with_bias(out, bias).view(*x.shape[:-1], -1)
    return quant_matmul_ref(x, qw, bias)


def _tiled_from_rows() -> int:
    raw = os.environ.get("FERRY_QUANT_TILED_FROM_ROWS", "64").strip()
    if not raw.isdigit() or int(raw) < 1:
        raise ValueError(f"FERRY_QUANT_TILED_FROM_ROWS={raw!r}: must be a whole number of rows >= 1")
    return int(raw)


TILED_FROM_ROWS = _tiled_from_rows()
"""From this many rows of x on, the C++ kernel dequantizes each weight block once into an fp32 buffer and
multiplies all rows with it (a register-blocked GEMM); below, it dequantizes in registers per pass of a few
rows (fewer bytes touched). Measured on a 2-core Zen 5 (AVX-512) with SmolLM2's shapes and every layer's weights
streamed from memory as in a step (ops/bench/quant/step_rows.py, report 20261204-smollm2-cpu-amd/): the
register passes are ahead below 64 rows (8 rows: int8 8.9 vs 12.4 ms, int4 6.1 vs 9.8 ms for a step's
matmuls; 32 rows: 22.9 vs 25.3, 18.9 vs 21.3), the two even at 64, the tiled GEMM ahead from ~128
(prefill). The 8 set before came from one weight timed over and over (matmul_rows.py), which stays in
cache. FERRY_QUANT_TILED_FROM_ROWS, read once at import, moves it (benchmarks: a huge value keeps the
register passes for every batch)."""


def cpu_quant_matmul(x: torch.Tensor, packed: CpuPacked, tiled_from_rows: int = TILED_FROM_ROWS) -> torch.Tensor:
    """The C++ kernel: x [M, K] fp32 -> [M, N] fp32."""
    if kernel() is None:
        raise RuntimeError("the C++ CPU kernels could not be built (see the warning logged above)")
    return torch.ops.ferry_cpu.quant_linear(
        x.contiguous(),
        packed.codes,
        packed.scales,
        packed.offsets,
        packed.bits,
        packed.group_size,
        packed.out_features,
        tiled_from_rows,
    )


def _with_bias(out: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return out if bias is None else out.add_(bias.to(out.dtype))
