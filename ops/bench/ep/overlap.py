"""Dual micro-batch overlap benchmark: step time of one batch, two micro-batches one after the
other and two overlapped, and the fraction of all-to-all time the overlap hides.
The code: ferry.bench.ep_overlap (`python -m ferry.bench.ep_overlap --help`)."""

from ferry.bench.ep_overlap import main

if __name__ == "__main__":
    main()
