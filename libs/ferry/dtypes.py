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


def check_dtype_name(name: str, field: str) -> str:
    """`name` if it is one of DTYPE_NAMES, else ValueError naming `field`."""
    if name not in DTYPE_NAMES:
        raise ValueError(f"{field}: unsupported {name!r}, expected one of {DTYPE_NAMES}")
    return name


def torch_dtype(name: str, field: str = "dtype") -> torch.dtype:
    import torch

    return getattr(torch, check_dtype_name(name, field))
