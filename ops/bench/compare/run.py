"""One comparison run: ferry up vs the engine in-process vs transformers serve, same workload.
The code: ferry.bench.compare.run (`python -m ferry.bench.compare.run --help`)."""

import sys

from ferry.bench.compare.run import main

if __name__ == "__main__":
    sys.exit(main())
