"""Store key names: `ferry:kv:<namespace>:<block_hash hex>`, one key per block.

The namespace is the model fingerprint, an opaque string to the store (it may contain ':'; the
hash is always the last field, so parsing splits from the right).
"""

from __future__ import annotations

from ferry.protocol.blocks import HASH_BYTES

KEY_PREFIX = "ferry:kv:"


def block_key(namespace: str, block_hash: bytes) -> str:
    if len(block_hash) != HASH_BYTES:
        raise ValueError(f"block_hash has {len(block_hash)} bytes, expected {HASH_BYTES}")
    return f"{KEY_PREFIX}{namespace}:{block_hash.hex()}"


def namespace_pattern(namespace: str | None = None) -> str:
    """Glob over every block key (of one namespace, or of all), for SCAN MATCH."""
    if namespace is None:
        return KEY_PREFIX + "*"
    escaped = "".join("\\" + c if c in "*?[]\\" else c for c in namespace)
    return f"{KEY_PREFIX}{escaped}:*"


def parse_block_key(key: str | bytes) -> tuple[str, bytes] | None:
    """(namespace, block_hash) of a block key, or None for any other key."""
    if isinstance(key, bytes):
        key = key.decode(errors="replace")
    if not key.startswith(KEY_PREFIX):
        return None
    namespace, sep, hex_hash = key[len(KEY_PREFIX) :].rpartition(":")
    if not sep or len(hex_hash) != 2 * HASH_BYTES:
        return None
    try:
        return namespace, bytes.fromhex(hex_hash)
    except ValueError:
        return None
