"""ferry.model: HF checkpoint loader, the supported architectures, the paged KV cache, make-model.

Names are imported lazily so that torch-free users (the gateway reads only the config and the
tokenizer) do not pay for importing torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "AttentionMetadata": "ferry.model.attention_meta",
    "LoadedModel": "ferry.model.loader",
    "ModelConfig": "ferry.model.config",
    "PagedKVCache": "ferry.model.kv_cache",
    "Tokenizer": "ferry.model.tokenizer",
    "load_model": "ferry.model.loader",
    "read_config": "ferry.model.config",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'ferry.model' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
