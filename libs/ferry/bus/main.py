"""A service's whole entry point: every `ferry_services.<name>.__main__` is one call to `service_main`.

Read the settings from `FERRY_*` (a bad value exits with one line naming the variable), set up
logging, then serve until a signal (`serve` ends in `ferry.bus.run_service`) and exit with its status.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from ferry.logs import setup_logging
from ferry.settings import ServiceSettings, load_settings

S = TypeVar("S", bound=ServiceSettings)


def service_main(
    name: str,
    settings_cls: type[S],
    serve: Callable[[S], Coroutine[Any, Any, int]],
    *,
    config_errors: tuple[type[Exception], ...] = (),
) -> int:
    """Run service `name`; an exception of `config_errors` (e.g. a missing model folder found only
    while starting) exits with one line, `ferry <name>: <message>`, instead of a traceback."""
    settings = load_settings(settings_cls)
    setup_logging(settings.log_level, settings.log_json)
    try:
        return asyncio.run(serve(settings))
    except config_errors as exc:
        raise SystemExit(f"ferry {name}: {exc}") from None
