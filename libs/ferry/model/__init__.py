"""ferry.model: HF checkpoint loader, the supported architectures, the paged KV cache, make-model."""

from ferry.model.attention_meta import AttentionMetadata
from ferry.model.config import ModelConfig
from ferry.model.kv_cache import PagedKVCache
from ferry.model.loader import LoadedModel, load_model
from ferry.model.tokenizer import Tokenizer

__all__ = ["AttentionMetadata", "LoadedModel", "ModelConfig", "PagedKVCache", "Tokenizer", "load_model"]
