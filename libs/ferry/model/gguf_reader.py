"""A GGUF file (llama.cpp's format), read with the `gguf` package: metadata -> ModelConfig, tensors ->
HF-named weights.

Two layers, so a quantized runtime can stop halfway: `raw_tensor` gives a weight's quantized blocks
as stored (rows already in HF order), `tensor` dequantizes them to a torch dtype. llama.cpp's
converter permutes the rows of Llama/Mistral Q and K projections (interleaved rotary pairs); ferry,
like HF, rotates halves, so those rows are put back here. Everything unsupported (architecture,
tensor type, an unknown tensor) is refused when the file is opened, naming the tensor and its type.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from functools import cached_property, lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, LlamaFileType
from gguf.quants import dequantize

from ferry.model.config import ModelConfig

if TYPE_CHECKING:  # torch only where tensors are made: the gateway reads config and tokenizer without it
    import torch

ARCHITECTURES = ("llama", "mistral", "qwen2")
ROW_PERMUTED_ARCHS = ("llama", "mistral")  # llama.cpp's converter permutes their Q/K rows
Q = GGMLQuantizationType
TENSOR_TYPES = (Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q4_K, Q.Q6_K)

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "rope_freqs.weight": "",  # Llama-3 rope factors: read into the config, not a parameter
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_LAYER_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


def is_gguf(path: str | Path) -> bool:
    return str(path).endswith(".gguf")


def open_gguf(path: str | Path) -> GgufFile:
    """One GgufFile per file and process (parsing the metadata takes a second or two); a file written
    anew at the same path is opened anew."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such GGUF file")
    stat = path.stat()
    return _open_cached(path.resolve(), stat.st_mtime_ns, stat.st_size)


@lru_cache(maxsize=4)
def _open_cached(path: Path, mtime_ns: int, size: int) -> GgufFile:
    return GgufFile(path)


def hf_name(gguf_name: str) -> str | None:
    """'blk.3.attn_q.weight' -> 'model.layers.3.self_attn.q_proj.weight'; None for an unknown tensor."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    match = _LAYER_RE.fullmatch(gguf_name)
    if match is None or match[2] not in _LAYER_NAMES:
        return None
    return f"model.layers.{match[1]}.{_LAYER_NAMES[match[2]]}.{match[3]}"


@dataclass(slots=True)
class RawTensor:
    """One weight as the file stores it, rows in HF order: the hand-off point for a quantized runtime."""

    name: str
    """The HF parameter name."""
    qtype: GGMLQuantizationType
    shape: tuple[int, ...]
    """The logical shape in torch order ([out, in] for a matrix)."""
    data: np.ndarray
    """[rows, bytes per row] uint8 blocks (or the plain float array for F32/F16/BF16), read-only."""


class GgufFile:
    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        if not self.path.is_file():
            raise FileNotFoundError(f"{self.path}: no such GGUF file")
        self._reader = GGUFReader(self.path, "r")
        self.arch = str(self.field("general.architecture"))
        if self.arch not in ARCHITECTURES:
            raise ValueError(f"{self.path}: architecture {self.arch!r} is not supported; supported: {ARCHITECTURES}")
        self._check_tensors()

    def field(self, key: str, default: Any = KeyError) -> Any:
        field = self._reader.fields.get(key)
        if field is None:
            if default is KeyError:
                raise ValueError(f"{self.path}: metadata {key!r} is missing")
            return default
        return field.contents()

    def arch_field(self, key: str, default: Any = KeyError) -> Any:
        return self.field(f"{self.arch}.{key}", default)

    @cached_property
    def _tensors(self) -> dict[str, Any]:
        return {t.name: t for t in self._reader.tensors}

    @cached_property
    def hf_names(self) -> dict[str, str]:
        """HF parameter name -> GGUF tensor name, for every parameter the file holds."""
        names = {name: hf_name(name) for name in self._tensors}
        return {hf: name for name, hf in names.items() if hf}

    def _check_tensors(self) -> None:
        for name, tensor in self._tensors.items():
            if tensor.tensor_type not in TENSOR_TYPES:
                supported = ", ".join(t.name for t in TENSOR_TYPES)
                raise ValueError(
                    f"{self.path}: tensor {name!r} has type {tensor.tensor_type.name}, "
                    f"which is not supported (supported: {supported})"
                )
            if hf_name(name) is None:
                raise ValueError(
                    f"{self.path}: tensor {name!r} ({tensor.tensor_type.name}) is not a known {self.arch} weight"
                )

    @cached_property
    def config(self) -> ModelConfig:
        from ferry.model.gguf_config import config_from_gguf

        return config_from_gguf(self)

    @property
    def file_type(self) -> str:
        """The file's weights type as llama.cpp names it ('Q4_1' for MOSTLY_Q4_1), else the most common
        type among its matrices."""
        value = self.field("general.file_type", None)
        if value is not None:
            try:
                return LlamaFileType(int(value)).name.removeprefix("MOSTLY_").removeprefix("ALL_")
            except ValueError:
                pass
        kinds = [t.tensor_type.name for t in self._tensors.values() if len(t.shape) == 2]
        return max(set(kinds), key=kinds.count) if kinds else "F32"

    def has_tensor(self, gguf_name: str) -> bool:
        return gguf_name in self._tensors

    def float_tensor(self, gguf_name: str) -> torch.Tensor:
        """A tensor by its GGUF name, dequantized to float32 as stored (no row reordering)."""
        import torch

        tensor = self._tensors[gguf_name]
        values = dequantize(tensor.data, tensor.tensor_type)
        return torch.from_numpy(np.array(values, dtype=np.float32))

    def raw_tensor(self, name: str) -> RawTensor:
        """The stored blocks of HF parameter `name`, Q/K rows un-permuted."""
        gguf_name = self.hf_names.get(name)
        if gguf_name is None:
            raise ValueError(f"{self.path}: missing tensor {name!r}")
        tensor = self._tensors[gguf_name]
        shape = tuple(int(n) for n in reversed(tensor.shape))  # GGUF lists dimensions innermost first
        data = self._unpermute(name, np.asarray(tensor.data))
        return RawTensor(name=name, qtype=tensor.tensor_type, shape=shape, data=data)

    def tensor(self, name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        """HF parameter `name`, dequantized to dtype (default float32), in torch's shape."""
        import torch

        raw = self.raw_tensor(name)
        values = dequantize(raw.data, raw.qtype).reshape(raw.shape)
        return torch.from_numpy(np.array(values, dtype=np.float32)).to(dtype or torch.float32)

    def _unpermute(self, name: str, rows: np.ndarray) -> np.ndarray:
        if self.arch not in ROW_PERMUTED_ARCHS:
            return rows
        if ".q_proj." in name:
            heads = self.config.num_heads
        elif ".k_proj." in name:
            heads = self.config.num_kv_heads
        else:
            return rows
        # the converter's permute: reshape(heads, 2, rows/heads/2, ...).swapaxes(1, 2); this is its inverse
        half = rows.shape[0] // heads // 2
        return rows.reshape(heads, half, 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)

    def digest(self) -> str:
        """Size, the metadata and 64 KiB from each end: tells files apart without hashing all of it."""
        digest = hashlib.sha256(str(self.path.stat().st_size).encode())
        with open(self.path, "rb") as f:
            digest.update(f.read(min(self._reader.data_offset, 1 << 20)))
            f.seek(self._reader.data_offset)
            digest.update(f.read(65536))
            f.seek(max(self._reader.data_offset, self.path.stat().st_size - 65536))
            digest.update(f.read())
        return digest.hexdigest()[:16]


def load_gguf_weights(module: torch.nn.Module, f: GgufFile) -> None:
    """Copies every parameter of module (a tied weight once) from the file, dequantized to its dtype."""
    import torch

    for name, param in module.named_parameters(remove_duplicate=True):
        value = f.tensor(name, param.dtype)
        if tuple(value.shape) != tuple(param.shape):
            raise ValueError(f"{f.path}: tensor {name!r} has shape {tuple(value.shape)}, expected {tuple(param.shape)}")
        with torch.no_grad():
            param.copy_(value)
