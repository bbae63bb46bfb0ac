"""`python -m ferry_services.decode_balancer` (also `ferry serve decode-balancer`)."""

import sys

from ferry.bus.main import service_main
from ferry_services.decode_balancer.service import serve
from ferry_services.decode_balancer.settings import DecodeBalancerSettings

if __name__ == "__main__":
    sys.exit(service_main("decode-balancer", DecodeBalancerSettings, serve))
