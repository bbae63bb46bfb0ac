"""Connecting to NATS: retry until a server answers, then reconnect forever.

In compose and k8s a service often starts before nats-server answers, so the first connect is
retried (tenacity) every `reconnect_wait_s` until `connect_timeout_s`. Once connected, nats-py
reconnects on its own (forever, `reconnect_wait_s` apart, holding publishes in a bounded buffer
meanwhile). Disconnects, reconnects and errors are logged here, failed attempts only now and then.
Credentials refused by the server end the wait at once: retrying cannot fix a wrong password.
URLs are logged without their credentials (`ferry.redact`).
"""

from __future__ import annotations

import asyncio
import logging

import nats.errors
from nats.aio.client import Client
from tenacity import AsyncRetrying, RetryCallState, retry_if_exception_type, stop_after_delay, wait_fixed

from ferry.redact import redact_url

log = logging.getLogger("ferry.bus")

RECONNECT_BUFFER_BYTES = 8 * 1024 * 1024
"""Publishes held while disconnected; beyond this a publish raises instead of growing memory."""
TRIES_PER_SERVER = 1
"""Per connect attempt, nats-py tries each server this many times more before giving the attempt up."""
RETRIED = (OSError, asyncio.TimeoutError, nats.errors.NoServersError, nats.errors.TimeoutError)
"""Failures worth another attempt: nobody listening (yet), or not answering in time."""


class CredentialsRefused(Exception):
    """The server answered and refused the user, password or token in the URL."""


class NatsUnreachable(TimeoutError):
    """No server answered within connect_timeout_s."""


async def connect(url: str, name: str, *, connect_timeout_s: float = 30.0, reconnect_wait_s: float = 0.5) -> Client:
    """Connect to `url` (comma-separated for a cluster) as client `name`, shown by `nats server report`.

    Tries every `reconnect_wait_s` until a server answers; raises TimeoutError after `connect_timeout_s`,
    CredentialsRefused at once when the server refuses the credentials."""
    if connect_timeout_s <= 0:
        raise ValueError(f"connect_timeout_s={connect_timeout_s!r} must be > 0")
    servers = [u.strip() for u in url.split(",") if u.strip()]
    if not servers:
        raise ValueError(f"url={redact_url(url)!r} names no NATS server")
    shown_url = redact_url(url)
    retrying = AsyncRetrying(
        stop=stop_after_delay(connect_timeout_s),
        wait=wait_fixed(reconnect_wait_s),
        retry=retry_if_exception_type(RETRIED),
        before_sleep=lambda state: _log_attempt(shown_url, state),
        reraise=True,
    )
    try:
        return await asyncio.wait_for(
            retrying(_connect_once, servers, name, reconnect_wait_s, connect_timeout_s), connect_timeout_s
        )
    except (*RETRIED, asyncio.TimeoutError):
        raise NatsUnreachable(f"no NATS server answered at {shown_url} within {connect_timeout_s}s") from None


def _log_attempt(shown_url: str, state: RetryCallState) -> None:
    if _worth_logging(state.attempt_number):
        exc = state.outcome.exception() if state.outcome else None
        log.warning("NATS %s not reachable (attempt %d): %s", shown_url, state.attempt_number, _redact_error(exc))


def _worth_logging(attempt: int) -> bool:
    """Failed tries are said once in a while, not every time: the 1st, the 10th, every 100th."""
    return attempt in (1, 10) or attempt % 100 == 0


def _redact_error(exc: BaseException | None) -> str:
    """nats-py puts the server URL (credentials included) into some errors."""
    return redact_url(str(exc)) if exc is not None else "?"


async def _connect_once(servers: list[str], name: str, reconnect_wait_s: float, connect_timeout_s: float) -> Client:
    """One attempt over every server; raises what the last server said."""
    nc = Client()
    connect_errors: list[Exception] = []
    try:
        await nc.connect(
            servers=servers,
            name=name,
            connect_timeout=min(2.0, connect_timeout_s),  # type: ignore[arg-type]  # annotated int, takes float s
            allow_reconnect=True,
            max_reconnect_attempts=TRIES_PER_SERVER,
            reconnect_time_wait=reconnect_wait_s,  # type: ignore[arg-type]  # annotated int, takes float s
            pending_size=RECONNECT_BUFFER_BYTES,
            **_callbacks(nc, connect_errors),
        )
    except nats.errors.NoServersError as exc:
        reason = connect_errors[-1] if connect_errors else None  # refused, timed out, bad credentials
        await nc.close()
        if _is_refused_credentials(reason):
            raise CredentialsRefused(f"NATS refused the credentials in {redact_url(','.join(servers))}") from None
        raise (reason if isinstance(reason, RETRIED) else exc) from None
    except BaseException:  # cancelled by connect()'s deadline, or an unexpected failure
        await nc.close()
        raise
    # Connected: from now on a service never gives up on its bus (nats-py reads this at each reconnect).
    nc.options["max_reconnect_attempts"] = -1
    return nc


def _is_refused_credentials(exc: Exception | None) -> bool:
    # nats-py reports the server's `-ERR 'Authorization Violation'` at connect as a plain Error
    return isinstance(exc, nats.errors.AuthorizationError) or "authorization violation" in str(exc).lower()


def _callbacks(nc: Client, connect_errors: list[Exception]) -> dict:
    """nats-py's callbacks; failures before the first connect go to `connect_errors`."""
    failed_reconnects = [0]

    async def on_disconnect() -> None:
        if nc.is_closed:  # our own close() or drain(), not a lost server
            log.debug("NATS connection closed")
        else:
            log.warning("NATS disconnected; reconnecting")

    async def on_reconnect() -> None:
        failed_reconnects[0] = 0
        log.warning("NATS reconnected to %s", redact_url(nc.connected_url.geturl()) if nc.connected_url else "?")

    async def on_error(exc: Exception) -> None:
        if nc.is_connected:
            log.error("NATS error: %s", _redact_error(exc))
        elif nc.is_reconnecting:  # lost after connecting: say so once in a while, not every try
            failed_reconnects[0] += 1
            if _worth_logging(failed_reconnects[0]):
                log.warning("NATS reconnect failed (attempt %d): %s", failed_reconnects[0], _redact_error(exc))
        else:  # a failed first connect: connect()'s retry logs those now and then
            connect_errors.append(exc)

    return {"disconnected_cb": on_disconnect, "reconnected_cb": on_reconnect, "error_cb": on_error}


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
