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

from ferry.dtypes import torch_dtype
from ferry.kernels import resolve_attention
from ferry.model.causal_lm import CausalLM, make_rotary
from ferry.model.config import ModelConfig, read_config
from ferry.model.gguf_reader import is_gguf, load_gguf_weights, open_gguf
from ferry.model.gguf_tokenizer import tokenizer_from_gguf
from ferry.model.kv_cache import KV_LAYOUT_VERSION
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
    """Architecture, dtype, KV layout version, config hash and weights digest; namespaces KV blocks."""
    path: Path
    """The checkpoint folder or GGUF file."""


def load_model(
    path: str | Path, device: str | torch.device = "cpu", dtype: str | torch.dtype | None = None
) -> LoadedModel:
    path = resolve_model(path)
    gguf = open_gguf(path) if is_gguf(path) else None
    if gguf is None and not path.is_dir():
        raise FileNotFoundError(f"{path}: not a checkpoint folder or .gguf file")
    config = gguf.config if gguf else read_config(path)
    torch_dtype = _torch_dtype(dtype or config.dtype)
    tokenizer = tokenizer_from_gguf(gguf) if gguf else Tokenizer.from_dir(path)
    with torch.device("meta"):
        model = CausalLM(config)
    # cast on the meta device (free), then allocate: memory is taken once, in the target dtype
    model = model.to(torch_dtype).to_empty(device=device)
    model.tie_weights()
    model.rotary = make_rotary(config).to(device)  # meta init left the frequencies empty
    if gguf:
        load_gguf_weights(model, gguf)
    else:
        load_weights(model, path)
    model.fuse_projections()
    if torch.device(device).type == "cpu":
        model.prepack_cpu_weights()
    model.eval()
    model.set_attention_backend(resolve_attention(device))  # the engine sets its own (EngineConfig.attention)
    dtype_name = str(torch_dtype).removeprefix("torch.")
    digest = gguf.digest() if gguf else weights_digest(path)
    fingerprint = hashlib.sha256(
        f"{config.arch}|{dtype_name}|kv{KV_LAYOUT_VERSION}|{config.config_hash()}|{digest}".encode()
    ).hexdigest()[:24]
    return LoadedModel(
        model=model,
        config=config,
        tokenizer=tokenizer,
        eos_token_ids=_eos_ids(path, config, tokenizer),
        is_random=config.is_random,
        fingerprint=f"{config.arch}-{dtype_name}-{fingerprint}",
        path=path,
    )


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
