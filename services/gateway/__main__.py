"""`python -m ferry_services.gateway` (also `ferry serve gateway`)."""

import asyncio
import sys

from ferry.logs import setup_logging
from ferry.settings import load_settings
from ferry_services.gateway.service import serve
from ferry_services.gateway.settings import GatewaySettings


def main() -> int:
    settings = load_settings(GatewaySettings)
    setup_logging(settings.log_level, settings.log_json)
    try:
        return asyncio.run(serve(settings))
    except (FileNotFoundError, ValueError) as exc:  # a bad FERRY_MODEL: one line, not a traceback
        raise SystemExit(f"ferry gateway: {exc}") from None


if __name__ == "__main__":
    sys.exit(main())
