"""A minimal streaming HTTP/1.1 client for time to first token as the socket sees it.

run.py measures TTFT with the bench's httpx client (what an SDK user sees). That client's own
Python work (building the request, its connection pool, parsing the SSE) costs 2-3 ms on the shared
2-core box, and it is not a service hop: the engine in-process pays nothing like it. This client
writes the request bytes and watches the raw stream, so the system's figure is the services'
alone. One keep-alive connection; the body is sent with Content-Length; the chunked response is
read until its terminating chunk.
"""

from __future__ import annotations

import asyncio
import json
import time
from urllib.parse import urlsplit


class SocketClient:
    def __init__(self, base_url: str) -> None:
        url = urlsplit(base_url)
        self.host, self.port = url.hostname or "127.0.0.1", url.port or 80
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None

    async def ttft_s(self, path: str, body: dict, timeout_s: float = 120.0) -> float:
        """Seconds from writing the request to the first SSE chunk carrying text; reads the rest."""
        if self._writer is None:
            self._reader, self._writer = await asyncio.open_connection(self.host, self.port)
        payload = json.dumps(body).encode()
        head = (
            f"POST {path} HTTP/1.1\r\nHost: {self.host}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(payload)}\r\n\r\n"
        ).encode()
        start = time.perf_counter()
        self._writer.write(head + payload)
        return await asyncio.wait_for(self._read_stream(start), timeout_s)

    async def _read_stream(self, start: float) -> float:
        assert self._reader is not None  # ttft_s opened the connection
        status = await self._reader.readline()
        if b" 200 " not in status:
            raise RuntimeError(f"HTTP status line {status!r}")
        first = None
        while True:
            line = await self._reader.readline()
            if not line:
                raise RuntimeError("connection closed mid-stream")
            if first is None and line.startswith(b"data: {") and b'"text"' in line:
                first = time.perf_counter() - start
            if line == b"0\r\n":  # the terminating chunk (after data: [DONE]); a blank line follows
                await self._reader.readline()
                if first is None:
                    raise RuntimeError("stream ended without a text chunk")
                return first

    async def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            await self._writer.wait_closed()
