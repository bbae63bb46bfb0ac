"""`python -m ferry_services.kvcache` (also `ferry serve kvcache`)."""

import sys

from ferry.bus.main import service_main
from ferry_services.kvcache.service import serve
from ferry_services.kvcache.settings import KvCacheSettings

if __name__ == "__main__":
    sys.exit(service_main("kvcache", KvCacheSettings, serve))
