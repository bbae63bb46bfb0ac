"""Redraw a comparison report (compare.md, compare.png) from its compare.json: `render.py FOLDER`.
The code: ferry.bench.compare.render."""

import sys
from pathlib import Path

from ferry.bench.compare.render import rerender

if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    rerender(Path(sys.argv[1]))
