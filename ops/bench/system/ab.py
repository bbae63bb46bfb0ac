"""Low-load TTFT of two versions of the services, side by side: before vs after a change.
The code: ferry.bench.system.ab (`python -m ferry.bench.system.ab --help`)."""

import sys

from ferry.bench.system.ab import main

if __name__ == "__main__":
    sys.exit(main())
