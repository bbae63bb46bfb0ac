"""`python -m ferry_services.worker` (also `ferry serve worker`)."""

import sys

from ferry.bus.main import service_main
from ferry_services.worker.service import serve
from ferry_services.worker.settings import WorkerSettings

if __name__ == "__main__":
    sys.exit(service_main("worker", WorkerSettings, serve))
