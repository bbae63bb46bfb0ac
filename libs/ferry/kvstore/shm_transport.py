"""Shared memory between the workers of one host: one file per block under a tmpfs folder.

`ShmTransport("/dev/shm/ferry-kv")` lets a prefill and a decode worker on the same machine hand KV
blocks over at memory speed, with no server in between. A value is written to a temporary file and
renamed into place, and a rename is atomic, so a reader sees a whole block or none (the same
guarantee as one Redis SET). Batches run in a thread so a 16 MiB transfer does not stall the
worker's event loop.

There is no eviction: the folder holds what the workers put until `clear()` or a reboot (tmpfs
lives in RAM), so size it for one run's hand-offs, or use Redis, which evicts LRU.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import shutil
import uuid
from collections.abc import Sequence
from pathlib import Path
from urllib.parse import quote

from ferry.kvstore.errors import KvStoreUnavailable

_MAX_NAME = 200  # file names stop at 255 bytes; long namespaces are hashed


class ShmTransport:
    """KvTransport over files in `root` (a tmpfs such as /dev/shm for shared memory)."""

    def __init__(self, root: str | os.PathLike = "/dev/shm/ferry-kv") -> None:
        self.root = Path(root)
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise KvStoreUnavailable(f"cannot use {self.root} for KV blocks: {exc}") from exc

    def path(self, key: str) -> Path:
        name = quote(key, safe="")
        if len(name) > _MAX_NAME:
            name = hashlib.sha256(key.encode()).hexdigest()
        return self.root / name

    async def set_many(self, items: Sequence[tuple[str, bytes]]) -> None:
        if items:
            await self._in_thread(self._write_all, items)

    async def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        return await self._in_thread(self._read_all, keys) if keys else []

    async def exists_many(self, keys: Sequence[str]) -> list[bool]:
        return [self.path(key).exists() for key in keys]

    async def delete_many(self, keys: Sequence[str]) -> None:
        for key in keys:
            self.path(key).unlink(missing_ok=True)

    async def close(self) -> None:
        """Nothing to release: the blocks stay for the other processes."""

    def clear(self) -> None:
        """Remove every block in `root` (and the folder)."""
        shutil.rmtree(self.root, ignore_errors=True)

    async def _in_thread(self, fn, arg):
        try:
            return await asyncio.to_thread(fn, arg)
        except OSError as exc:  # folder removed, tmpfs full, permissions
            raise KvStoreUnavailable(f"shared-memory KV store at {self.root}: {exc}") from exc

    def _write_all(self, items: Sequence[tuple[str, bytes]]) -> None:
        for key, value in items:
            tmp = self.root / f".tmp-{uuid.uuid4().hex}"
            try:
                with open(tmp, "wb") as f:
                    f.write(value)
                os.replace(tmp, self.path(key))  # atomic: readers see the old file, the new one, or none
            finally:
                tmp.unlink(missing_ok=True)

    def _read_all(self, keys: Sequence[str]) -> list[bytes | None]:
        out: list[bytes | None] = []
        for key in keys:
            try:
                out.append(self.path(key).read_bytes())
            except FileNotFoundError:
                out.append(None)
        return out
