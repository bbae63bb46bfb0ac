"""What the microservice split costs: the whole system (`ferry up`) vs the same engine in-process.
The code: ferry.bench.system.run (`python -m ferry.bench.system.run --help`)."""

import sys

from ferry.bench.system.run import main

if __name__ == "__main__":
    sys.exit(main())
