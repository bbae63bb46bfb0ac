"""`python -m ferry_services.prefill_balancer` (also `ferry serve prefill-balancer`)."""

import sys

from ferry.bus.main import service_main
from ferry_services.prefill_balancer.service import serve
from ferry_services.prefill_balancer.settings import PrefillBalancerSettings

if __name__ == "__main__":
    sys.exit(service_main("prefill-balancer", PrefillBalancerSettings, serve))
