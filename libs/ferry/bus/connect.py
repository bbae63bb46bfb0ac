"""Connecting to NATS: retry until a server answers, then reconnect forever.

In compose and k8s a service often starts before nats-server answers, so the first connect is
retried every `reconnect_wait_s` until `connect_timeout_s`. Once connected, nats-py reconnects
on its own (forever, `reconnect_wait_s` apart, holding publishes in a bounded buffer meanwhile).
Disconnects, reconnects and errors are logged here, failed attempts only now and then.
"""

from __future__ import annotations

import asyncio
import logging

from nats.aio.client import Client

log = logging.getLogger("ferry.bus")

RECONNECT_BUFFER_BYTES = 8 * 1024 * 1024
"""Publishes held while disconnected; beyond this a publish raises instead of growing memory."""


async def connect(url: str, name: str, *, connect_timeout_s: float = 30.0, reconnect_wait_s: float = 0.5) -> Client:
    """Connect to `url` (comma-separated for a cluster) as client `name`, shown by `nats server report`.

    Tries every `reconnect_wait_s` until a server answers; raises TimeoutError after `connect_timeout_s`."""
    if connect_timeout_s <= 0:
        raise ValueError(f"connect_timeout_s={connect_timeout_s!r} must be > 0")
    servers = [u.strip() for u in url.split(",") if u.strip()]
    if not servers:
        raise ValueError(f"url={url!r} names no NATS server")
    nc = Client()
    attempts = [0]  # failed tries, for sparse logging

    async def on_disconnect() -> None:
        if nc.is_closed:  # our own close() or drain(), not a lost server
            log.debug("NATS connection closed")
        else:
            log.warning("NATS disconnected; reconnecting")

    async def on_reconnect() -> None:
        log.warning("NATS reconnected to %s", nc.connected_url.netloc if nc.connected_url else "?")

    async def on_error(exc: Exception) -> None:
        if nc.is_connected:
            log.error("NATS error: %r", exc)
        else:  # a failed (re)connect attempt: say so once in a while, not every try
            attempts[0] += 1
            if attempts[0] in (1, 10) or attempts[0] % 100 == 0:
                log.warning("NATS %s not reachable (attempt %d): %s", url, attempts[0], exc)

    try:
        await asyncio.wait_for(
            nc.connect(
                servers=servers,
                name=name,
                connect_timeout=min(2.0, connect_timeout_s),
                allow_reconnect=True,
                max_reconnect_attempts=-1,  # a service never gives up on its bus, at start or later
                reconnect_time_wait=reconnect_wait_s,
                pending_size=RECONNECT_BUFFER_BYTES,
                disconnected_cb=on_disconnect,
                reconnected_cb=on_reconnect,
                error_cb=on_error,
            ),
            timeout=connect_timeout_s,
        )
    except asyncio.TimeoutError:
        await nc.close()
        raise TimeoutError(f"no NATS server answered at {url} within {connect_timeout_s}s") from None
    return nc


async def drain_or_close(nc: Client) -> None:
    """Drain so everything already published goes out; just close when the server is gone first
    (nats-py's drain raises while reconnecting, and close can hit a dead socket)."""
    if nc.is_closed:
        return
    try:
        await nc.drain()
    except Exception as exc:  # nats-py raises several unrelated types here
        log.warning("NATS drain failed (%r); closing", exc)
        try:
            await nc.close()
        except OSError:
            pass
