"""Issue #22's throughput run: one seeded burst through every system, in one invocation.
The code: ferry.bench.throughput.run (`python -m ferry.bench.throughput.run --help`)."""

import sys

from ferry.bench.throughput.run import main

if __name__ == "__main__":
    sys.exit(main())
