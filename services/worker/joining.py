"""How a sequence joins the engine, for both roles: with the KV fetched for it, or from its tokens.

The prefill worker may have fetched a prompt's leading blocks from the store (a prefix reuse: an
optional speed-up, counted as cached, computed instead when there is no room for it); the decode
worker fetched a hand-off's blocks (the sequence's own state: no room means the worker holds the
message and tries again after the next step). Missing KV means computing it from the tokens. Runs on
the engine thread.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

from ferry.protocol import GenerateRequest
from ferry_services.worker.ledger import engine_id


class Joined(enum.Enum):
    WITH_KV = "with_kv"
    """The fetched KV was loaded; only the rest is computed."""
    RECOMPUTE = "recompute"
    """Queued to compute from the tokens (no KV, or no room for optional KV)."""
    NO_ROOM = "no_room"
    """Refused: not enough free blocks now for KV that is the sequence's own."""


@dataclass(slots=True)
class FetchedKV:
    data: Any
    """The leading blocks of prompt + outputs, [n, *block_shape], staged on their way to the
    engine's device (LLMEngine.stage_kv: an InCopy) or a host tensor."""
    num_tokens: int
    """Tokens it covers."""


def join(engine: Any, request: GenerateRequest, kv: FetchedKV | None, kv_is_optional: bool) -> Joined:
    """Add `request` (as its attempt's engine id) to `engine`; see `Joined`. Raises ValueError when
    the request cannot fit this engine at all (the client's fault)."""
    sequence_id = engine_id(request)
    if kv is not None and engine.can_admit(len(request.all_token_ids)):
        engine.add_prefilled(
            sequence_id,
            request.prompt_token_ids,
            request.output_token_ids,
            request.sampling,
            kv.data,
            kv.num_tokens,
            count_as_cached=kv_is_optional,
        )
        return Joined.WITH_KV
    if kv is not None and not kv_is_optional:
        return Joined.NO_ROOM
    engine.add_request(
        sequence_id,
        request.prompt_token_ids,
        request.sampling,
        request.output_token_ids,
        request.arrival_time or None,
    )
    return Joined.RECOMPUTE
