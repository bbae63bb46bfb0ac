"""load_model: a HF checkpoint folder -> LoadedModel (module, config, tokenizer, EOS ids, fingerprint).

Reads config.json, *.safetensors, tokenizer.json + tokenizer_config.json and generation_config.json
from the folder only; nothing touches the network.
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
from ferry.model.kv_cache import KV_LAYOUT_VERSION
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
    """The checkpoint folder."""


def load_model(
    path: str | Path, device: str | torch.device = "cpu", dtype: str | torch.dtype | None = None
) -> LoadedModel:
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"{path}: not a checkpoint folder")
    config = read_config(path)
    torch_dtype = _torch_dtype(dtype or config.dtype)
    tokenizer = Tokenizer.from_dir(path)
    with torch.device("meta"):
        model = CausalLM(config)
    # cast on the meta device (free), then allocate: memory is taken once, in the target dtype
    model = model.to(torch_dtype).to_empty(device=device)
    model.tie_weights()
    model.rotary = make_rotary(config).to(device)  # meta init left the frequencies empty
    load_weights(model, path)
    model.fuse_projections()
    if torch.device(device).type == "cpu":
        model.prepack_cpu_weights()
    model.eval()
    model.set_attention_backend(resolve_attention(device))  # the engine sets its own (EngineConfig.attention)
    dtype_name = str(torch_dtype).removeprefix("torch.")
    fingerprint = hashlib.sha256(
        f"{config.arch}|{dtype_name}|kv{KV_LAYOUT_VERSION}|{config.config_hash()}|{weights_digest(path)}".encode()
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
    if file.exists():
        value = json.loads(file.read_text()).get("eos_token_id")
        if value is not None:
            return [int(v) for v in (value if isinstance(value, list) else [value])]
    if config.eos_token_ids:
        return list(config.eos_token_ids)
    eos = tokenizer.token_id("eos_token")
    return [] if eos is None else [eos]
