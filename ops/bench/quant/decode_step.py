"""Decode step with int8 / int4 weights vs fp32, interleaved in one run.
The code: ferry.bench.quant_decode (`python -m ferry.bench.quant_decode --help`)."""

import sys

from ferry.bench.quant_decode import main

if __name__ == "__main__":
    sys.exit(main())
