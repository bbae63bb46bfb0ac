"""`--weights-dtype auto` for a GGUF file: its Q8_0 / Q4_0 / Q4_1 matrices are kept as they are stored,
as quant_ref QuantizedWeights, without a second rounding (group 32 and the fp16 scales are exact in
our layout; Q4_0/Q4_1 pack each block's weight j in the low nibble and j + 16 in the high one, as ours).
  Q8_0 (34 bytes per 32 weights: fp16 d, 32 int8)        -> int8, w = q * d
  Q4_0 (18 bytes: fp16 d, 16 bytes of nibbles)           -> int4, w = (u - 8) * d (offsets None)
  Q4_1 (20 bytes: fp16 d, fp16 m, 16 bytes of nibbles)   -> int4, w = u * d + m (offsets m)
Other types (F32/F16/BF16, and K-quants, which ferry dequantizes at load) stay float. A fused matrix
(q/k/v, gate/up) is kept quantized when all its parts are of one width.
"""

from __future__ import annotations

import numpy as np
import torch

from ferry.kernels.quant_ref import QuantizedWeight
from ferry.model.quant_linear import Quantizer

GROUP = 32
_BLOCK_BYTES = {"Q8_0": 34, "Q4_0": 18, "Q4_1": 20}


def from_raw(qtype: str, shape: tuple[int, ...], data: np.ndarray) -> QuantizedWeight | None:
    """One stored matrix ([rows, bytes per row] uint8 blocks, torch shape [out, in]) -> its QuantizedWeight,
    or None for a type kept float."""
    if qtype not in _BLOCK_BYTES or len(shape) != 2:
        return None
    rows, cols = shape
    blocks = np.ascontiguousarray(data, dtype=np.uint8).reshape(rows, cols // GROUP, _BLOCK_BYTES[qtype])
    scales = torch.from_numpy(blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32))
    if qtype == "Q8_0":
        codes = torch.from_numpy(blocks[..., 2:].copy().view(np.int8).reshape(rows, cols))
        return QuantizedWeight(codes, scales, None, 8, GROUP)
    first = 2 if qtype == "Q4_0" else 4
    codes = torch.from_numpy(blocks[..., first:].copy().reshape(rows, cols // 2))
    offsets = None
    if qtype == "Q4_1":
        offsets = torch.from_numpy(blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32))
    return QuantizedWeight(codes, scales, offsets, 4, GROUP)


def concat_rows(parts: list[QuantizedWeight]) -> QuantizedWeight | None:
    """Parts of one fused matrix stacked by rows; None unless all have one width."""
    if len({p.bits for p in parts}) != 1:
        return None
    if len(parts) == 1:
        return parts[0]
    offsets = None
    if any(p.offsets is not None for p in parts):
        offsets = torch.cat([p.offsets if p.offsets is not None else -8.0 * p.scales for p in parts])
    return QuantizedWeight(
        torch.cat([p.qweight for p in parts]), torch.cat([p.scales for p in parts]), offsets, parts[0].bits, GROUP
    )


def gguf_quantizer(gguf, tie_word_embeddings: bool) -> Quantizer:
    """quantize_linears' quantizer for `auto` on gguf (a ferry.model.gguf_reader.GgufFile)."""

    def raw(name: str) -> QuantizedWeight | None:
        if name == "lm_head.weight" and tie_word_embeddings and name not in gguf.hf_names:
            name = "model.embed_tokens.weight"  # the tied table is the LM head
        tensor = gguf.raw_tensor(name)
        return from_raw(tensor.qtype.name, tensor.shape, tensor.data)

    def quantizer(names: list[str], weight: torch.Tensor) -> QuantizedWeight | None:
        parts = [raw(name) for name in names]
        kept = [p for p in parts if p is not None]
        return concat_rows(kept) if len(kept) == len(parts) else None

    return quantizer
