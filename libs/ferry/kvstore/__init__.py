"""KV blocks outside the workers: block codec, store transports (Redis, memory, ...), `KvStore`.

See docs/internals.md, "KV store", for the contract the workers code against. The names that need
torch (codec, `KvStore`) load on first use, so the kvcache service, which never touches a tensor,
starts without importing torch.
"""

import importlib

from ferry.kvstore.errors import KvStoreError, KvStoreUnavailable
from ferry.kvstore.keys import KEY_PREFIX, block_key, namespace_pattern, parse_block_key
from ferry.kvstore.redis_transport import RedisTransport, connect_redis
from ferry.kvstore.shm_transport import ShmTransport
from ferry.kvstore.transport import KvTransport, MemoryTransport, num_leading_present

_LAZY = {
    "BlockCorrupt": "codec",
    "BlockMismatch": "codec",
    "check_block": "codec",
    "decode_block": "codec",
    "encode_block": "codec",
    "KvStore": "store",
    "KvStoreStats": "store",
}

__all__ = [
    "KvStoreError",
    "KvStoreUnavailable",
    "KEY_PREFIX",
    "block_key",
    "namespace_pattern",
    "parse_block_key",
    "RedisTransport",
    "connect_redis",
    "ShmTransport",
    "KvTransport",
    "MemoryTransport",
    "num_leading_present",
    *_LAZY,
]


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'ferry.kvstore' has no attribute {name!r}")
    return getattr(importlib.import_module(f"ferry.kvstore.{module}"), name)
