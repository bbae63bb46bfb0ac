"""EPLB benchmark: max/mean rank load before and after EPLB on a skewed routing trace.
The code: ferry.bench.eplb (`python -m ferry.bench.eplb --help`)."""

from ferry.bench.eplb import main

if __name__ == "__main__":
    main()
