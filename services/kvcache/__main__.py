"""`python -m ferry_services.kvcache` (also `ferry serve kvcache`)."""

import asyncio
import sys

from ferry.logs import setup_logging
from ferry.settings import load_settings
from ferry_services.kvcache.service import serve
from ferry_services.kvcache.settings import KvCacheSettings


def main() -> int:
    settings = load_settings(KvCacheSettings)
    setup_logging(settings.log_level, settings.log_json)
    return asyncio.run(serve(settings))


if __name__ == "__main__":
    sys.exit(main())
