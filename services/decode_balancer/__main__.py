"""`python -m ferry_services.decode_balancer` (also `ferry serve decode-balancer`)."""

import asyncio
import sys

from ferry.logs import setup_logging
from ferry.settings import load_settings
from ferry_services.decode_balancer.service import serve
from ferry_services.decode_balancer.settings import DecodeBalancerSettings


def main() -> int:
    settings = load_settings(DecodeBalancerSettings)
    setup_logging(settings.log_level, settings.log_json)
    return asyncio.run(serve(settings))


if __name__ == "__main__":
    sys.exit(main())
