"""Where one request's time to first token goes, hop by hop, through `ferry up`.
The code: ferry.bench.system.trace (`python -m ferry.bench.system.trace --help`)."""

import sys

from ferry.bench.system.trace import main

if __name__ == "__main__":
    sys.exit(main())
