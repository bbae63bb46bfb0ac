"""`python -m ferry_services.gateway` (also `ferry serve gateway`)."""

import sys

from ferry.bus.main import service_main
from ferry_services.gateway.service import serve
from ferry_services.gateway.settings import GatewaySettings

if __name__ == "__main__":
    # a bad FERRY_MODEL (no folder, no tokenizer) is found while starting: one line, not a traceback
    sys.exit(service_main("gateway", GatewaySettings, serve, config_errors=(FileNotFoundError, ValueError)))
