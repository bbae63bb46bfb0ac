"""What the gateway needs from the checkpoint: tokenizer, chat template, context length, vocab size.

Only config.json and the tokenizer files (of a GGUF: its metadata) are read, never the weights; the
tokenizer is the model runtime's (`ferry.model.tokenizer.Tokenizer`), so prompts tokenize exactly as the workers expect.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol


class Tokenizer(Protocol):
    """The part of `ferry.model.tokenizer.Tokenizer` the gateway uses."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...
    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...
    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> str: ...


@dataclass(slots=True)
class ModelInfo:
    tokenizer: Tokenizer
    max_context_len: int
    """config.json max_position_embeddings."""
    vocab_size: int
    arch: str = ""
    """llama, qwen2, ... (config)."""
    checkpoint_dtype: str = ""
    """What the checkpoint stores its weights in: a GGUF's type (Q4_1, ...) or a torch dtype."""


def load_model_info(model_dir: str) -> ModelInfo:
    # Imported here: the model package pulls in torch, which `--help` and tests of the schemas skip.
    from ferry.model.config import read_config
    from ferry.model.describe import checkpoint_dtype
    from ferry.model.tokenizer import Tokenizer as ModelTokenizer

    config = read_config(model_dir)
    return ModelInfo(
        tokenizer=ModelTokenizer.from_path(model_dir),
        max_context_len=config.max_position_embeddings,
        vocab_size=config.vocab_size,
        arch=config.arch,
        checkpoint_dtype=checkpoint_dtype(config),
    )
