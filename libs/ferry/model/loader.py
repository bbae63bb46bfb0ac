"""load_model: a HF checkpoint folder or a GGUF file -> LoadedModel (module, config, tokenizer, EOS ids,
fingerprint).

A folder: config.json, *.safetensors, tokenizer.json + tokenizer_config.json and generation_config.json.
A `.gguf` file: its metadata, tensors (dequantized) and tokenizer (ferry.model.gguf_reader). Nothing
touches the network.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import torch

from ferry.dtypes import WEIGHTS_DTYPES, torch_dtype
from ferry.kernels import resolve_attention
from ferry.kernels.quant_ref import DEFAULT_GROUP_SIZE
from ferry.model.causal_lm import CausalLM, make_rotary
from ferry.model.config import ModelConfig, read_config
from ferry.model.gguf_quant import gguf_quantizer
from ferry.model.gguf_reader import is_gguf, load_gguf_weights, open_gguf
from ferry.model.gguf_tokenizer import tokenizer_from_gguf
from ferry.model.kv_cache import KV_LAYOUT_VERSION
from ferry.model.quant_linear import QUANT_BITS, held_bits, quantize_linears, symmetric
from ferry.model.source import resolve_model
from ferry.model.tokenizer import Tokenizer
from ferry.model.weights import load_weights, weights_digest


@dataclass(slots=True)
class LoadedModel:
    model: CausalLM
    """The module: forward(input_ids, positions, meta, kv) and make_kv_cache(...)."""
    config: ModelConfig
    """Architecture and sizes, parsed from config.json."""
    tokenizer: Tokenizer
    """Encode/decode and the chat template."""
    eos_token_ids: list[int]
    """Token ids that end generation (generation_config.json, else config.json, else the tokenizer)."""
    is_random: bool
    """True for a `ferry make-model` checkpoint: its weights are random, its text meaningless."""
    fingerprint: str
    """Architecture, weights dtype, KV layout version, config hash and weights digest; namespaces KV
    blocks, so engines holding differently quantized weights of one checkpoint never share them."""
    path: Path
    """The checkpoint folder or GGUF file."""
    weights_dtype: str = "float32"
    """How the projections' weights are held: float32, bfloat16, float16, int8 or int4."""


def load_model(
    path: str | Path,
    device: str | torch.device = "cpu",
    dtype: str | torch.dtype | None = None,
    weights_dtype: str = "auto",
) -> LoadedModel:
    """weights_dtype (WEIGHTS_DTYPES): 'auto' keeps the checkpoint's (a GGUF's Q8_0/Q4_0/Q4_1 matrices stay
    quantized, ferry.model.gguf_quant; other types are dequantized); float32/bfloat16 are the model dtype
    (dtype, when also given, must agree); int8/int4 quantize the projections group-wise after loading,
    activations then run in dtype, by default float32 (what the C++ kernel takes)."""
    path = resolve_model(path)
    gguf = open_gguf(path) if is_gguf(path) else None
    if gguf is None and not path.is_dir():
        raise FileNotFoundError(f"{path}: not a checkpoint folder or .gguf file")
    config = gguf.config if gguf else read_config(path)
    model_dtype = _torch_dtype(_model_dtype(dtype, weights_dtype) or config.dtype)
    tokenizer = tokenizer_from_gguf(gguf) if gguf else Tokenizer.from_dir(path)
    with torch.device("meta"):
        model = CausalLM(config)
    # cast on the meta device (free), then allocate: memory is taken once, in the target dtype
    model = model.to(model_dtype).to_empty(device=device)
    model.tie_weights()
    model.rotary = make_rotary(config).to(device)  # meta init left the frequencies empty
    if gguf:
        load_gguf_weights(model, gguf)
    else:
        load_weights(model, path)
    model.fuse_projections()
    held = str(model_dtype).removeprefix("torch.")
    if weights_dtype in QUANT_BITS:
        quantize_linears(model, symmetric(QUANT_BITS[weights_dtype], DEFAULT_GROUP_SIZE))
        held = f"{weights_dtype}g{DEFAULT_GROUP_SIZE}-{held}"  # codes, group size and activation dtype
    elif weights_dtype == "auto" and gguf and quantize_linears(model, gguf_quantizer(gguf, config.tie_word_embeddings)):
        held = f"gguf-{_bits_name(model)}-{held}"  # the file's own Q8_0/Q4_x codes
    if held_bits(model):
        setattr(model, "weights_dtype", _bits_name(model))  # noqa: B010 (nn.Module's typed __setattr__); read by ferry.model.describe (a GGUF may mix int8 and int4)
    if torch.device(device).type == "cpu":
        model.prepack_cpu_weights()
    model.eval()
    model.set_attention_backend(resolve_attention(device))  # the engine sets its own (EngineConfig.attention)
    digest = gguf.digest() if gguf else weights_digest(path)
    fingerprint = hashlib.sha256(
        f"{config.arch}|{held}|kv{KV_LAYOUT_VERSION}|{config.config_hash()}|{digest}".encode()
    ).hexdigest()[:24]
    return LoadedModel(
        model=model,
        config=config,
        tokenizer=tokenizer,
        eos_token_ids=_eos_ids(path, config, tokenizer),
        is_random=config.is_random,
        fingerprint=f"{config.arch}-{held}-{fingerprint}",
        path=path,
        weights_dtype=_bits_name(model) or str(model_dtype).removeprefix("torch."),
    )


def _bits_name(model: CausalLM) -> str:
    """'int8', 'int4', 'int8+int4' (a GGUF's mix), or '' when no weight is quantized."""
    return "+".join(f"int{bits}" for bits in held_bits(model))


def _model_dtype(dtype: str | torch.dtype | None, weights_dtype: str) -> str | torch.dtype | None:
    """The dtype the model is built in: dtype, else float32/bfloat16 from weights_dtype, float32 under
    int8/int4, None (the checkpoint's) under auto."""
    if weights_dtype not in WEIGHTS_DTYPES:
        raise ValueError(f"weights_dtype: unsupported {weights_dtype!r}, expected one of {WEIGHTS_DTYPES}")
    implied = {"auto": None, "int8": "float32", "int4": "float32"}.get(weights_dtype, weights_dtype)
    if (
        dtype is not None
        and weights_dtype in ("float32", "bfloat16")
        and _torch_dtype(dtype) != _torch_dtype(weights_dtype)
    ):
        raise ValueError(f"dtype {dtype!r} and weights_dtype {weights_dtype!r} disagree")
    return dtype or implied


def _torch_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    return torch_dtype(dtype)


def _eos_ids(path: Path, config: ModelConfig, tokenizer: Tokenizer) -> list[int]:
    file = path / "generation_config.json"
    if path.is_dir() and file.exists():
        value = json.loads(file.read_text()).get("eos_token_id")
        if value is not None:
            return [int(v) for v in (value if isinstance(value, list) else [value])]
    if config.eos_token_ids:
        return list(config.eos_token_ids)
    eos = tokenizer.token_id("eos_token")
    return [] if eos is None else [eos]
