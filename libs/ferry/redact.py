"""Secrets out of anything that is shown: URLs with credentials, for logs, errors and status lines.

Services take their credentials inside URLs (`nats://worker:<password>@nats:4222`,
`redis://:<password>@redis:6379/0`, `nats://<token>@host`), so every place that prints a URL
prints `redact_url(url)` instead. The URL stays usable for the eye (scheme, user, host, port,
path) and never carries a password, a token or a secret query parameter.
"""

from __future__ import annotations

import re
from urllib.parse import parse_qsl, urlencode

REDACTED = "***"
SECRET_QUERY_KEYS = frozenset({"password", "pass", "pwd", "token", "auth", "secret", "nkey", "jwt", "key"})
"""Query parameters whose values are secrets (`redis://host?password=...`)."""

_USERINFO = re.compile(r"^(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*://)(?P<userinfo>[^/?#]*)@")


def redact_url(url: str) -> str:
    """`url` (or a comma-separated list of URLs) with passwords, tokens and secret query values
    replaced by `***`: `nats://worker:pw@h:4222` -> `nats://worker:***@h:4222`,
    `nats://tok@h` -> `nats://***@h`."""
    return ",".join(_redact_one(part) for part in url.split(","))


def _redact_one(url: str) -> str:
    url = _USERINFO.sub(_redact_userinfo, url, count=1)
    base, sep, query = url.partition("?")
    if not sep:
        return url
    query, hash_sep, fragment = query.partition("#")
    pairs = parse_qsl(query, keep_blank_values=True)
    pairs = [(k, REDACTED if k.lower() in SECRET_QUERY_KEYS else v) for k, v in pairs]
    return f"{base}?{urlencode(pairs, safe='*')}{hash_sep}{fragment}"


def _redact_userinfo(match: re.Match) -> str:
    user, has_password, _ = match["userinfo"].partition(":")
    # `user:password@` keeps the user (it names a role, not a secret); a lone `token@` is all secret.
    shown = f"{user}:{REDACTED}" if has_password else REDACTED
    return f"{match['scheme']}{shown}@"
