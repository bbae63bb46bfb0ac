"""What is served, in words for /v1/models and the ferry_model_info metric: architecture, the dtype the
checkpoint stores its weights in, and the dtype the loaded model multiplies with."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ferry.model.config import ModelConfig

if TYPE_CHECKING:
    from torch import nn


def checkpoint_dtype(config: ModelConfig) -> str:
    """A GGUF's file type (Q4_1, Q8_0, F16, ...), else the checkpoint's torch dtype (float32, bfloat16)."""
    return str(config.raw.get("gguf_file_type") or config.dtype)


def weights_dtype(model: nn.Module) -> str:
    """What the weight matmuls hold: a quantized layer says so in a `weights_dtype` attribute ('int8',
    'int4'); otherwise the torch dtype of the output projection's weight."""
    for module in model.modules():
        declared = getattr(module, "weights_dtype", None)
        if isinstance(declared, str):
            return declared
    return str(model.get_parameter("lm_head.weight").dtype).removeprefix("torch.")
