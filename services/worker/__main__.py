"""`python -m ferry_services.worker` (also `ferry serve worker`)."""

import asyncio
import sys

from ferry.logs import setup_logging
from ferry.settings import load_settings
from ferry_services.worker.service import serve
from ferry_services.worker.settings import WorkerSettings


def main() -> int:
    settings = load_settings(WorkerSettings)
    setup_logging(settings.log_level, settings.log_json)
    return asyncio.run(serve(settings))


if __name__ == "__main__":
    sys.exit(main())
