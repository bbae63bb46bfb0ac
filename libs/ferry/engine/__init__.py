"""ferry.engine: sequences, block manager, scheduler, sampler, detokenizer, runner and LLMEngine.

Importing this package stays light; `LLMEngine` (torch + the model) loads on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ferry.engine.config import EngineConfig

if TYPE_CHECKING:
    from ferry.engine.llm_engine import LLMEngine
    from ferry.engine.outputs import EngineStats, PrefilledKV, RequestOutput

__all__ = ["EngineConfig", "EngineStats", "LLMEngine", "PrefilledKV", "RequestOutput"]


def __getattr__(name: str):
    if name == "LLMEngine":
        from ferry.engine.llm_engine import LLMEngine

        return LLMEngine
    if name in ("EngineStats", "PrefilledKV", "RequestOutput"):
        from ferry.engine import outputs

        return getattr(outputs, name)
    raise AttributeError(name)
