"""A NATS CLI context for a running `ferry up`, so `nats --context ferry-up micro ls` works at once.

The file is what `nats context save NAME --server URL` writes: JSON in `$XDG_CONFIG_HOME/nats/context/
NAME.json` (default `~/.config/nats/context/`), with the server URL and, split out of it, the user
and password or token. Saving one does not select it: the user's current context stays current.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from urllib.parse import unquote, urlsplit

NAME_PATTERN = re.compile(r"^[A-Za-z0-9_.-]+$")
"""The CLI refuses names with a path separator or '..'."""


def context_dir() -> Path:
    """Where the nats CLI looks for contexts."""
    config_home = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(config_home) / "nats" / "context"


def context_fields(url: str, description: str) -> dict[str, object]:
    """The context's JSON: credentials move out of the URL(s) into user/password or token."""
    servers, user, password, token = [], "", "", ""
    for part in (p.strip() for p in url.split(",") if p.strip()):
        parts = urlsplit(part)
        if parts.username is not None:
            if parts.password is not None:
                user, password = unquote(parts.username), unquote(parts.password)
            else:
                token = unquote(parts.username)
        host = parts.hostname or ""
        servers.append(f"{parts.scheme}://{host}:{parts.port}" if parts.port else f"{parts.scheme}://{host}")
    return {
        "description": description,
        "url": ",".join(servers),
        "token": token,
        "user": user,
        "password": password,
        "creds": "",
        "nkey": "",
        "cert": "",
        "key": "",
        "ca": "",
        "nsc": "",
        "jetstream_domain": "",
        "jetstream_api_prefix": "",
        "jetstream_event_prefix": "",
        "inbox_prefix": "",
        "user_jwt": "",
        "color_scheme": "",
        "tls_first": False,
    }


def save_context(name: str, url: str, description: str, directory: Path | None = None) -> Path:
    """Write (or replace) context `name` for `url`; private to the user (it may hold a password)."""
    if not NAME_PATTERN.match(name) or ".." in name:
        raise ValueError(f"--nats-context {name!r}: use letters, digits, '.', '_' and '-'")
    directory = directory or context_dir()
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{name}.json"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(context_fields(url, description), f, indent=2)
        f.write("\n")
    path.chmod(0o600)  # O_CREAT's mode does not apply to a file that existed
    return path
