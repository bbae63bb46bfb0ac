"""Decode-step benchmark: fused CPU kernel vs torch reference vs transformers.
The code: ferry.bench.model_decode (`python -m ferry.bench.model_decode --help`)."""

import sys

from ferry.bench.model_decode import main

if __name__ == "__main__":
    sys.exit(main())
