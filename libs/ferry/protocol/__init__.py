"""The wire contract: message types, subjects, codec, block hashes. No I/O."""

from ferry.protocol import subjects
from ferry.protocol.blocks import HASH_BYTES, ROOT_HASH, hash_block, hash_full_blocks
from ferry.protocol.codec import (
    MAX_MESSAGE_BYTES,
    PROTOCOL_VERSION,
    ProtocolError,
    decode,
    encode,
    message_types,
)
from ferry.protocol.messages import (
    FINISH_REASONS,
    ROLES,
    BlockRef,
    Cancel,
    ErrorEvent,
    ErrorReply,
    GenerateRequest,
    Handoff,
    HandoffReply,
    KvEvent,
    KvLookup,
    KvLookupReply,
    KvStats,
    KvStatsRequest,
    LoadReport,
    OutputBatch,
    PrefillWork,
    SamplingParams,
    SubmitReply,
    SubmitRequest,
    TokenEvent,
    TokenLogprob,
)

__all__ = [
    "subjects", "HASH_BYTES", "ROOT_HASH", "hash_block", "hash_full_blocks", "MAX_MESSAGE_BYTES",
    "PROTOCOL_VERSION", "ProtocolError", "decode", "encode", "message_types", "FINISH_REASONS",
    "ROLES", "BlockRef", "Cancel", "ErrorEvent", "ErrorReply", "GenerateRequest", "Handoff",
    "HandoffReply", "KvEvent", "KvLookup", "KvLookupReply", "KvStats", "KvStatsRequest", "LoadReport",
    "OutputBatch", "PrefillWork", "SamplingParams", "SubmitReply", "SubmitRequest", "TokenEvent", "TokenLogprob",
]
