"""Weights kept in int8 / int4: QuantLinear, and quantize_linears, which swaps a loaded model's weight
matmuls for QuantLinears.

Every projection of every layer (the fused q/k/v and gate/up matrices, o_proj, down_proj) and lm_head is
quantized group-wise (ferry.kernels.quant_ref) and multiplies through ferry.kernels.quant_linear, which
dequantizes in registers. The fp32 copies are dropped (the per-projection Linears whose weights were
slices of a fused matrix become None), so the weights held are the quantized ones; the embedding table
stays in the model dtype (a lookup reads one row per token), also when lm_head is tied to it.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

import torch
from torch import nn

from ferry.kernels import quant_linear as kernels
from ferry.kernels.quant_linear import bf16_copy_matmul, dot_arguments, pack_cpu, quant_matmul
from ferry.kernels.quant_pack import CpuPacked, DotPacked
from ferry.kernels.quant_ref import DEFAULT_GROUP_SIZE, QuantizedWeight, dequantize, quantize

QUANT_BITS = {"int8": 8, "int4": 4}


class QuantLinear(nn.Module):
    """y = x @ W.T + b for a group-wise quantized W; callable like Linear and FusedProjection."""

    def __init__(self, qw: QuantizedWeight, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.register_buffer("qweight", qw.qweight)
        self.register_buffer("scales", qw.scales)
        self.register_buffer("offsets", qw.offsets)
        self.register_buffer("bias", None if bias is None else bias.detach().float().clone())
        self.qw = qw  # the same tensors, validated once (not per call)

    @classmethod
    def from_weight(cls, weight: torch.Tensor, bias: torch.Tensor | None, bits: int, group_size: int) -> QuantLinear:
        return cls(quantize(weight, bits, group_size), bias)

    @property
    def weights_dtype(self) -> str:
        """'int8' or 'int4' (what ferry.model.describe reports)."""
        return f"int{self.qw.bits}"

    @property
    def in_features(self) -> int:
        return self.qw.in_features

    @property
    def out_features(self) -> int:
        return self.qw.out_features

    packed: CpuPacked | DotPacked | None = None
    backend: str | None = None
    """One of ATTENTION_BACKENDS, set with the attention layers' (CausalLM.set_attention_backend)."""

    def prepack(self) -> None:
        """On the CPU: the C++ kernel's copy (quant_pack.py, the layout of the kernel pack_cpu picks), beside the
        row-major codes that the reference and the Triton kernel read (together ~2x the quantized bytes, still
        under fp32's)."""
        if self.packed is None and self.qweight.device.type == "cpu":  # its parent's prepack may call it too
            self.packed = pack_cpu(self.qw)
            if isinstance(self.packed, DotPacked):
                self.dot_call = (torch.ops.ferry_cpu.quant_dot_linear.default, dot_arguments(self.packed))
            nbytes = 2 * self.qw.in_features * self.qw.out_features
            if kernels.BF16_COPY_FROM_ROWS and kernels.reserve_bf16_copy(nbytes):  # within BF16_COPY_MAX_BYTES
                self.bf16_copy = kernels.pack_bf16_copy(dequantize(self.qw, torch.bfloat16))
                weakref.finalize(self, kernels.release_bf16_copy, nbytes)

    bf16_copy: torch.Tensor | None = None
    """Where kernels.BF16_COPY_FROM_ROWS > 0 (on by default with AMX or AVX512_BF16): the weight dequantized to
    bfloat16 and packed at prepack (kernels.pack_bf16_copy: for our AMX or AVX512_BF16 GEMM, 6-D, or for oneDNN, 2-D),
    which multiplies calls of that many rows or more (2 bytes a weight beside the codes)."""

    dot_call: tuple | None = None
    """(the int8-activation op, its arguments after x), bound at prepack: a decode step makes ~120 of these
    calls, and quant_matmul's dispatch (checks, reshapes, the packet lookup) took ~half of each one's ~13 us
    of Python (measured at batch 8 on SmolLM2's o_proj shape, 1 thread)."""

    def copy_multiplies(self, x: torch.Tensor) -> bool:
        """Whether forward multiplies x [..., in] through the bf16 copy (copy_takes its rows)."""
        return x.shape[-1] > 0 and self.copy_takes(x.numel() // x.shape[-1], x.dtype, x.device.type)

    def copy_takes(self, num_rows: int, dtype: torch.dtype, device_type: str) -> bool:
        """Whether num_rows rows of dtype on device_type go through the bf16 copy: BF16_COPY_FROM_ROWS+ fp32 (or,
        from a previous copy matmul, bf16) rows on the CPU."""
        return (
            self.bf16_copy is not None
            and self.backend == "cpu"
            and (dtype == torch.float32 or dtype == torch.bfloat16)
            and device_type == "cpu"
            and 0 < kernels.BF16_COPY_FROM_ROWS <= num_rows
        )

    def bf16_forward(self, x: torch.Tensor) -> torch.Tensor | None:
        """[..., in] -> [..., out] in bf16 where the copy multiplies x and kernels.BF16_ACTIVATIONS is on (for a
        caller whose next step is another copy matmul: no round trip through fp32), else None."""
        if not (kernels.BF16_ACTIVATIONS and self.bias is None and self.copy_multiplies(x)):
            return None
        assert self.bf16_copy is not None
        return bf16_copy_matmul(x.reshape(-1, x.shape[-1]), self.bf16_copy, torch.bfloat16, self.qw.out_features).view(
            *x.shape[:-1], -1
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in] -> [..., out]
        bias = self.bias
        assert bias is None or isinstance(bias, torch.Tensor)
        copy = self.bf16_copy
        if (  # a batch of BF16_COPY_FROM_ROWS+ fp32 (or, from a copy matmul, bf16) rows on the CPU: AMX tiles
            copy is not None  # inline, not copy_multiplies: ~120 calls a decode step
            and self.backend == "cpu"
            and (x.dtype == torch.float32 or x.dtype == torch.bfloat16)
            and x.device.type == "cpu"
            and 0 < kernels.BF16_COPY_FROM_ROWS * x.shape[-1] <= x.numel()
        ):
            out = bf16_copy_matmul(x.reshape(-1, x.shape[-1]), copy, torch.float32, self.qw.out_features).view(
                *x.shape[:-1], -1
            )
            return out if bias is None else out.add_(bias)
        call = self.dot_call
        if (  # the decode step's case, fp32 rows on the CPU: straight to the kernel (it checks x against the codes)
            call is not None
            and self.backend == "cpu"
            and x.dtype == torch.float32
            and x.dim() == 2
            and x.device.type == "cpu"
            and x.is_contiguous()
            and not (kernels.BF16_FROM_ROWS and x.shape[0] >= kernels.BF16_FROM_ROWS)
        ):
            out = call[0](x, *call[1])
            return out if bias is None else out.add_(bias)
        return quant_matmul(x, self.qw, bias, self.packed, self.backend)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, bits={self.qw.bits}, group={self.qw.group_size}"


Quantizer = Callable[[list[str], torch.Tensor], "QuantizedWeight | None"]
"""(parameter names of the matmul's parts, its fp32 weight) -> its quantized weight, or None: keep it float."""


def symmetric(bits: int, group_size: int = DEFAULT_GROUP_SIZE) -> Quantizer:
    """The int8 / int4 quantizer of --weights-dtype int8 / int4: quant_ref.quantize of the weight."""
    return lambda names, weight: quantize(weight, bits, group_size)


def quantize_linears(model: nn.Module, quantizer: Quantizer) -> int:
    """After fuse_projections: each FusedProjection and each other Linear of model that quantizer quantizes
    becomes a QuantLinear (the Linears whose weights were slices of a quantized fused matrix become None:
    it does their matmuls). -> how many matmuls were quantized. Refuses MLA models, whose attention
    reads kv_b_proj's weight directly."""
    from ferry.model.cpu_linear import FusedProjection, Linear

    if getattr(getattr(model, "config", None), "is_mla", False):
        raise ValueError("weights_dtype int8/int4: MLA (DeepSeek-style) models are not supported; use float32/bfloat16")
    count = 0
    for prefix, module in list(model.named_modules()):
        parts = [name for name, c in module.named_children() if isinstance(c, Linear) and c.is_fused]
        for name, value in list(vars(module).items()):
            if isinstance(value, FusedProjection):
                qw = quantizer([_weight_name(prefix, part) for part in parts], value.weight)
                if qw is not None:
                    setattr(module, name, QuantLinear(qw, value.bias))
                    for part in parts:
                        setattr(module, part, None)
                    count += 1
        for name, child in list(module.named_children()):
            if isinstance(child, Linear) and not child.is_fused:
                qw = quantizer([_weight_name(prefix, name)], child.weight)
                if qw is not None:
                    setattr(module, name, QuantLinear(qw, child.bias))
                    count += 1
    return count


def _weight_name(prefix: str, child: str) -> str:
    return f"{prefix}.{child}.weight" if prefix else f"{child}.weight"


def held_bits(model: nn.Module) -> list[int]:
    """The distinct code widths of model's QuantLinears, widest first ([] when none)."""
    return sorted({m.qw.bits for m in model.modules() if isinstance(m, QuantLinear)}, reverse=True)


def quantized_bytes(model: nn.Module) -> int:
    """Bytes of the quantized weights held by model's QuantLinears."""
    return sum(m.qw.nbytes() for m in model.modules() if isinstance(m, QuantLinear))
