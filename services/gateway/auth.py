"""API keys and request-size limits, as one ASGI layer in front of the gateway's app.

Keys come from `FERRY_API_KEYS` (comma separated) and/or `FERRY_API_KEY_FILE` (one per line, '#'
comments). With no key configured the gateway is open, and says so once at start; it refuses to
start open on an address other machines can reach (`exposure_problem`) unless FERRY_ALLOW_OPEN=1. A request must
carry `Authorization: Bearer <key>`; the key is checked against every configured key in constant
time (SHA-256 of both sides, then `hmac.compare_digest`, without stopping at the first match), so
neither the match position nor a key's length leaks through timing. Probes (`/health`, `/ready`)
stay open: Kubernetes calls them without credentials and they reveal nothing secret.

Bodies larger than `FERRY_MAX_BODY_BYTES` get 413 before the app parses anything: a declared
Content-Length over the limit is refused at once, a chunked body as soon as it crosses it.
No key ever appears in a log line or an error body. `lone_surrogate_field` finds text JSON can
carry but no tokenizer or msgpack can (a lone UTF-16 surrogate), so the app answers 400, not 500.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import json
import logging
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ferry.bus import trace
from ferry_services.gateway.errors import error_body

log = logging.getLogger("ferry.gateway")

OPEN_PATHS = frozenset({"/health", "/ready"})


class ApiKeys:
    """The configured keys, kept only as SHA-256 digests."""

    def __init__(self, keys: Iterable[str]) -> None:
        self._digests = [_digest(k) for k in dict.fromkeys(k.strip() for k in keys) if k]

    @classmethod
    def from_settings(cls, api_keys: str, api_key_file: str) -> ApiKeys:
        keys = api_keys.split(",") if api_keys else []
        if api_key_file:
            try:
                lines = Path(api_key_file).read_text(encoding="utf-8").splitlines()
            except OSError as exc:  # the path is not secret; the content would be
                raise ValueError(f"api_key_file: cannot read {api_key_file!r} ({exc.strerror})") from None
            keys += [line for line in lines if line.strip() and not line.lstrip().startswith("#")]
        return cls(keys)

    @property
    def enabled(self) -> bool:
        return bool(self._digests)

    def __len__(self) -> int:
        return len(self._digests)

    def allows(self, authorization: str | None) -> bool:
        """True for `Bearer <a configured key>`; always True when no key is configured."""
        if not self._digests:
            return True
        scheme, _, token = (authorization or "").partition(" ")
        given = _digest(token.strip() if scheme.lower() == "bearer" else "")
        ok = False
        for digest in self._digests:  # no early exit: every key is compared
            ok |= hmac.compare_digest(given, digest)
        return ok and bool(token.strip())


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).digest()


class BodyTooLarge(Exception):
    pass


class GuardMiddleware:
    """Checks the API key, then bounds the body, then calls the app with the body replayed."""

    def __init__(self, app: ASGIApp, keys: ApiKeys, max_body_bytes: int) -> None:
        if max_body_bytes < 1:
            raise ValueError(f"max_body_bytes={max_body_bytes} must be >= 1")
        self.app = app
        self.keys = keys
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        trace.hop("*", "gw.asgi")  # FERRY_TRACE_FILE only: where the client's part of a request ends
        headers = _headers(scope)
        if scope.get("path") not in OPEN_PATHS and not self.keys.allows(headers.get("authorization")):
            await _reply(
                send,
                401,
                "Incorrect or missing API key: send `Authorization: Bearer <key>`.",
                "invalid_api_key",
                {"www-authenticate": "Bearer"},
            )
            return
        declared = headers.get("content-length", "")
        if declared.isdigit() and int(declared) > self.max_body_bytes:
            await _reply(send, 413, self._too_large_message(), "request_too_large")
            return
        try:
            body, more = await self._read_body(receive)
        except BodyTooLarge:
            await _reply(send, 413, self._too_large_message(), "request_too_large")
            return
        await self.app(scope, _replay(body, more, receive), send)

    def _too_large_message(self) -> str:
        return f"request body is larger than {self.max_body_bytes} bytes (FERRY_MAX_BODY_BYTES)"

    async def _read_body(self, receive: Receive) -> tuple[bytes, Message | None]:
        """The whole body, or BodyTooLarge; a non-body message (disconnect) is handed on."""
        parts: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return b"".join(parts), message
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                raise BodyTooLarge
            parts.append(chunk)
            if not message.get("more_body", False):
                return b"".join(parts), None


def _replay(body: bytes, pending: Message | None, receive: Receive) -> Receive:
    """A receive() that first yields the buffered body, then whatever the client sends next."""
    sent = False

    async def replayed() -> Message:
        nonlocal sent, pending
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        if pending is not None:
            message, pending = pending, None
            return message
        return await receive()

    return replayed


def _headers(scope: Scope) -> dict[str, str]:
    return {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}


async def _reply(send: Send, status: int, message: str, code: str, extra: dict[str, str] | None = None) -> None:
    payload = json.dumps(error_body(status, message, code=code)).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]
    headers += [(k.encode(), v.encode()) for k, v in (extra or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": payload})


def lone_surrogate_field(value: Any, path: str = "") -> str | None:
    """The path of the first string holding a lone UTF-16 surrogate (JSON allows `"\\ud800"`, but
    no tokenizer or msgpack can take it), or None. Walks a request body's `model_dump()`."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return path or "body"
    elif isinstance(value, dict):
        for key, item in value.items():
            found = lone_surrogate_field(item, f"{path}.{key}" if path else str(key))
            if found:
                return found
    elif isinstance(value, list):
        for i, item in enumerate(value):
            if not isinstance(item, (str, dict, list)):
                continue  # a token id: no path string built for each of a long prompt's ids
            found = lone_surrogate_field(item, f"{path}[{i}]")
            if found:
                return found
    return None


def is_loopback(host: str) -> bool:
    """True for an address only this machine reaches (127.0.0.0/8, ::1, localhost)."""
    if host.strip().lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip().strip("[]")).is_loopback
    except ValueError:  # a host name: it resolves to who knows what
        return False


def exposure_problem(host: str, keys: ApiKeys, allow_open: bool) -> str:
    """Why the gateway must not start like this ('' = fine): open to every machine that reaches `host`."""
    if keys.enabled or allow_open or is_loopback(host):
        return ""
    return (
        f"ferry gateway: FERRY_HTTP_HOST={host} is reachable from other machines and no API key is set: "
        "set FERRY_API_KEYS or FERRY_API_KEY_FILE (python ops/make_secrets.py makes one), "
        "or FERRY_ALLOW_OPEN=1 to serve without keys on purpose"
    )


def install_guard(app, keys: ApiKeys, max_body_bytes: int) -> None:
    """Put the guard outermost and log (without any key) whether the gateway is open."""
    app.add_middleware(GuardMiddleware, keys=keys, max_body_bytes=max_body_bytes)
    if keys.enabled:
        log.info("API keys required: %d key(s) configured; /health and /ready are open", len(keys))
    else:
        log.warning("no API key configured (FERRY_API_KEYS / FERRY_API_KEY_FILE): the gateway is OPEN to anyone")
