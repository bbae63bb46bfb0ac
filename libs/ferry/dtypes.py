"""The floating-point dtypes ferry runs a model or a KV cache in: one table, by the names configs,
settings and command lines use. No torch at import (settings and pure modules read the names);
`torch_dtype` maps a name to torch's. What a kernel or the KV wire format supports is its own,
narrower list next to it (ferry.kernels.cpu_decode, ferry.kvstore.codec).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

DTYPE_NAMES: tuple[str, ...] = ("float32", "bfloat16", "float16")
WEIGHTS_DTYPES: tuple[str, ...] = ("auto", "float32", "bfloat16", "int8", "int4")
"""How projection weights are held (--weights-dtype): 'auto' keeps the checkpoint's (a GGUF's
quantization), float32/bfloat16 set the model dtype, int8/int4 quantize them at load (ferry.model.quant_linear)."""
KV_CACHE_DTYPES: tuple[str, ...] = (*DTYPE_NAMES, "float8_e4m3fn")
"""What the paged KV cache may hold (--kv-cache-dtype, FERRY_KV_CACHE_DTYPE): a model dtype, or fp8 e4m3 (no
scales, as vLLM's fp8 KV cache; CPU only: written once by write_kv, widened to fp32 in registers by the fused
decode kernel). A torch float8 tensor lacks some index ops and numpy: views as uint8 move its bytes."""


def check_dtype_name(name: str, field: str, names: tuple[str, ...] = DTYPE_NAMES) -> str:
    """`name` if it is one of names, else ValueError naming `field`."""
    if name not in names:
        raise ValueError(f"{field}: unsupported {name!r}, expected one of {names}")
    return name


def torch_dtype(name: str, field: str = "dtype") -> torch.dtype:
    import torch

    return getattr(torch, check_dtype_name(name, field))


def raw_view(tensor: torch.Tensor) -> torch.Tensor:
    """A float8 tensor as uint8 (the same bytes, any strides), else the tensor: torch's CPU index_copy_,
    torch.equal and .numpy() do not take float8, and moving bytes needs no arithmetic."""
    import torch

    return tensor.view(torch.uint8) if tensor.dtype.is_floating_point and tensor.dtype.itemsize == 1 else tensor
