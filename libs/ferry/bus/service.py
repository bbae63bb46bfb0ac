"""A ferry service on NATS: typed endpoints and subscriptions, every handler wrapped, NATS micro.

Handlers receive decoded `ferry.protocol` messages and never see bytes. Whatever goes wrong in one
message (bad bytes, an exception, an unencodable reply) becomes an `ErrorReply` to the requester
plus a counted, logged error; the subscription keeps serving the next message. Each service
registers with NATS micro (nats-py's `nats.micro`, see micro.py) so `nats micro ls/info/stats`
(subjects `$SRV.PING|INFO|STATS[.name[.id]]`) list it with per-endpoint request and error counts:
its endpoints, its subscriptions, and its *inputs*, work that does not arrive as a core-NATS message
(a worker's JetStream pulls), counted by their owner with `record()`.

nats-py runs one subscription's callbacks one after another, so a handler that may take long
should start a task and return.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.micro.service import NAME_REGEX, SEMVER_REGEX, ServiceConfig

from ferry.bus import micro
from ferry.logs import request_context
from ferry.protocol import ErrorReply, ProtocolError, decode, encode

log = logging.getLogger("ferry.bus")

M = TypeVar("M")
StatsData = Callable[[], Any]
"""Returns what $SRV.STATS shows as an endpoint's `data` (JSON-serializable), or None."""


class BusError(Exception):
    """Raise in a handler to answer `ErrorReply(code, message)`: an expected refusal, still counted."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


@dataclass(slots=True)
class EndpointStats:
    """Counters of one endpoint or subscription; what `$SRV.STATS` reports for it."""

    name: str
    subject: str
    queue_group: str
    """'' for a subscription every replica receives."""
    kind: str
    """'endpoint' (request/reply), 'subscription' (pub/sub) or 'input' (counted by its owner)."""
    num_requests: int = 0
    """Messages received, bad ones included."""
    num_errors: int = 0
    """Bad bytes, handler exceptions and BusErrors."""
    last_error: str = ""
    processing_time_ns: int = 0

    def record(self, processing_time_ns: int, error: str | None = None) -> None:
        """One message or work item handled, in `processing_time_ns`; `error` says what went wrong."""
        self.num_requests += 1
        self.processing_time_ns += processing_time_ns
        if error is not None:
            self.count_error(error)

    def count_error(self, error: str) -> None:
        self.num_errors += 1
        self.last_error = error


class _Handler:
    """One subscription: decodes, calls the user's handler, answers, counts. Never raises."""

    def __init__(self, stats: EndpointStats, msg_type: type, handler: Callable[[Any], Awaitable[Any]]) -> None:
        self.stats = stats
        self.msg_type = msg_type
        self.handler = handler
        self.is_endpoint = stats.kind == "endpoint"
        self.subscription: Subscription | None = None
        self.nc: Client | None = None  # set by Service.start

    async def on_message(self, msg: Msg) -> None:
        start_ns = time.perf_counter_ns()
        self.stats.num_requests += 1
        try:
            await self._handle(msg)
        finally:
            self.stats.processing_time_ns += time.perf_counter_ns() - start_ns

    def _decode(self, data: bytes) -> Any:
        """An empty payload (`nats req ferry.kv.stats ''` from the CLI) means every field at its default."""
        if not data and self.is_endpoint:
            try:
                return self.msg_type()
            except TypeError:
                raise ProtocolError(f"empty request: {self.msg_type.__name__} has required fields") from None
        return decode(data, self.msg_type)

    async def _handle(self, msg: Msg) -> None:
        try:
            request = self._decode(msg.data)
        except ProtocolError as exc:
            log.warning("%s: bad message on %s: %s", self.stats.name, msg.subject, exc)
            await self._fail(msg, "bad_request", str(exc))
            return
        with request_context(_request_id_of(request)):
            try:
                reply = await self.handler(request)
                if self.is_endpoint:
                    await self._respond(msg, encode(reply))
            except BusError as exc:
                log.info("%s: refused: %s", self.stats.name, exc)
                await self._fail(msg, exc.code, exc.message)
            except Exception as exc:  # the point of the wrapper: one bad message never kills the service
                log.exception("%s: handler failed", self.stats.name)
                await self._fail(msg, "internal", repr(exc))

    async def _fail(self, msg: Msg, code: str, message: str) -> None:
        self.stats.count_error(f"{code}: {message}")
        # a header value must be one short line: CR/LF in it would corrupt the NATS protocol stream
        description = " ".join(message.split())[:1024]
        headers = {micro.ERROR_HEADER: description, micro.ERROR_CODE_HEADER: code}
        await self._respond(msg, encode(ErrorReply(code=code, message=message)), headers)

    async def _respond(self, msg: Msg, data: bytes, headers: dict[str, str] | None = None) -> None:
        if not msg.reply or self.nc is None:  # a publish, not a request: nobody to answer
            return
        try:
            await self.nc.publish(msg.reply, data, headers=headers)
        except Exception:  # connection closing or reconnect buffer full: the requester will time out
            log.warning("could not reply on %s", msg.reply, exc_info=True)


def _request_id_of(message: Any) -> str | None:
    """The request a message is about, for log lines: `.request_id` or `.request.request_id`."""
    rid = getattr(message, "request_id", None)
    if rid is None:
        rid = getattr(getattr(message, "request", None), "request_id", None)
    return rid if isinstance(rid, str) else None


def _name_from_subject(subject: str) -> str:
    return subject.replace(".", "_").replace("*", "any").replace(">", "all")


class Service:
    """A named NATS micro service holding typed endpoints, subscriptions and counted inputs."""

    def __init__(
        self, name: str, version: str = "0.1.0", description: str = "", metadata: dict[str, str] | None = None
    ) -> None:
        if not NAME_REGEX.match(name):
            raise ValueError(f"name={name!r} must be letters, digits, '-' or '_'")
        if not SEMVER_REGEX.match(version):
            raise ValueError(f"version={version!r} must be semantic (e.g. 0.1.0)")
        self.name = name
        self.version = version
        self.description = description
        self.metadata = dict(metadata or {})
        """Served live by PING/INFO/STATS: update it in place while running."""
        self.draining = asyncio.Event()
        """Set when shutdown starts; background loops should stop taking new work."""
        self._handlers: dict[str, _Handler] = {}
        self._inputs: dict[str, EndpointStats] = {}
        self._stats_data: dict[str, StatsData] = {}
        self._micro: micro.MicroRegistration | None = None
        self._nc: Client | None = None

    @property
    def id(self) -> str:
        """This instance's micro id (assigned by `start`)."""
        return self._micro.id if self._micro else ""

    def endpoint(
        self,
        subject: str,
        request_type: type[M],
        handler: Callable[[M], Awaitable[Any]],
        queue: str | None = None,
        name: str | None = None,
        data: StatsData | None = None,
    ) -> None:
        """Request/reply: `handler(request) -> reply message`. Replicas share a queue group."""
        stats = self._add("endpoint", subject, queue or self.name, name, data)
        self._handlers[stats.name] = _Handler(stats, request_type, handler)

    def subscribe(
        self,
        subject: str,
        msg_type: type[M],
        handler: Callable[[M], Awaitable[None]],
        queue: str | None = None,
        name: str | None = None,
        data: StatsData | None = None,
    ) -> None:
        """Pub/sub: `handler(msg) -> None`. Without `queue` every replica gets every message."""
        stats = self._add("subscription", subject, queue or "", name, data)
        self._handlers[stats.name] = _Handler(stats, msg_type, handler)

    def input(self, name: str, subject: str, data: StatsData | None = None) -> EndpointStats:
        """Work that reaches this service other than as a core-NATS message (a JetStream pull): listed
        in $SRV.INFO/STATS like an endpoint; the owner counts each item with `.record(ns, error=None)`."""
        stats = self._add("input", subject, "", name, data)
        self._inputs[stats.name] = stats
        return stats

    def _add(self, kind: str, subject: str, queue: str, name: str | None, data: StatsData | None) -> EndpointStats:
        if self._nc is not None:
            raise RuntimeError(f"{self.name}: add endpoints, subscriptions and inputs before start()")
        if not subject or " " in subject:
            raise ValueError(f"subject={subject!r} must be a NATS subject")
        name = name or _name_from_subject(subject)
        if not NAME_REGEX.match(name):
            raise ValueError(f"name={name!r} must be letters, digits, '-' or '_'")
        if name in self._handlers or name in self._inputs:
            raise ValueError(f"name={name!r} is already used by {self._counters()[name].subject}")
        if data is not None:
            self._stats_data[name] = data
        return EndpointStats(name=name, subject=subject, queue_group=queue, kind=kind)

    async def start(self, nc: Client) -> None:
        """Subscribe every endpoint and subscription, then answer `$SRV.*` (nats.micro)."""
        if self._nc is not None:
            raise RuntimeError(f"{self.name}: already started")
        self._nc = nc
        for h in self._handlers.values():
            h.nc = nc
            h.subscription = await nc.subscribe(h.stats.subject, queue=h.stats.queue_group, cb=h.on_message)
        config = ServiceConfig(
            name=self.name,
            version=self.version,
            description=self.description,
            metadata=self.metadata,
            stats_handler=self._data_of,
        )
        self._micro = micro.MicroRegistration(nc, config, lambda: self._counters().values())
        await self._micro.start()  # subscribes $SRV.*, then flushes
        # nats-py's flush() writes its PING straight to the socket, ahead of the SUBs still buffered for its
        # flusher task (nats-py 2.9-2.16), so that PONG does not prove the server holds them, and a message
        # published right after start() could find no subscriber. The buffered SUBs were handed to the
        # socket before that PONG was read, so a second PING goes out behind them: its PONG does prove it.
        await nc.flush()
        log.info(
            "service %s %s started (id %s): %s",
            self.name,
            self.version,
            self.id,
            ", ".join(c.subject for c in self._counters().values()),
        )

    async def stop(self) -> None:
        """Drain every subscription (in-flight handlers finish), then leave `$SRV.*`. Idempotent."""
        self.draining.set()
        for h in self._handlers.values():
            if h.subscription is not None:
                sub, h.subscription = h.subscription, None
                await _drain(sub)
        if self._micro is not None:
            await self._micro.stop()

    def stats(self) -> dict[str, EndpointStats]:
        """A snapshot of every endpoint's, subscription's and input's counters, by name."""
        return {name: dataclasses.replace(stats) for name, stats in self._counters().items()}

    def num_pending(self, name: str) -> int:
        """Messages of endpoint/subscription `name` delivered to this process and not yet handled
        (nats-py's pending queue: each subscription's handler runs them one at a time)."""
        sub = self._handlers[name].subscription
        return sub.pending_msgs if sub is not None else 0

    def _counters(self) -> dict[str, EndpointStats]:
        return {**{name: h.stats for name, h in self._handlers.items()}, **self._inputs}

    def _data_of(self, endpoint: Any) -> Any:
        """nats.micro's stats_handler: the `data` of one endpoint in $SRV.STATS."""
        data = self._stats_data.get(endpoint.name)
        if data is None:
            return None
        try:
            return data()
        except Exception as exc:  # a broken callback must not take STATS down with it
            log.warning("%s: stats data of %s failed", self.name, endpoint.name, exc_info=True)
            return {"error": repr(exc)}


async def _drain(sub: Subscription) -> None:
    try:
        await sub.drain()
    except Exception:  # connection already closed: nothing left to drain
        log.debug("drain of %s failed", sub.subject, exc_info=True)
