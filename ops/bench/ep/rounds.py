"""Per-round breakdown of an overlap report (`overlap.py --out DIR` wrote DIR/overlap.json): per phase
and round the hidden fraction and what is left of the all-to-all time, split into the critical rank's
blocked time in overlap and its extra compute (dC); and which rank was critical in how many steps.

    python ops/bench/ep/rounds.py DIR [DIR ...]
"""

from __future__ import annotations

import json
import sys
from collections import Counter
from pathlib import Path


def critical_ranks(raw: list[dict], phase: str, mode: str, start: int, stop: int) -> Counter:
    """How many of the steps [start, stop) each rank was critical in (computed longest)."""
    counts: Counter = Counter()
    for samples in list(zip(*(rank[phase][mode] for rank in raw)))[start:stop]:
        computes = [s["step_s"] - s["a2a_s"] - s["all_gather_s"] for s in samples]
        counts[max(range(len(samples)), key=computes.__getitem__)] += 1
    return counts


def main() -> None:
    for folder in sys.argv[1:]:
        report = json.loads((Path(folder) / "overlap.json").read_text())
        print(f"== {folder}")
        for phase, data in report["result"].items():
            per_round = data["per_round"]
            steps = report["params"][f"{phase}_steps"]
            for r, hidden in enumerate(per_round["hidden_fraction"]):
                seq = critical_ranks(report["raw"], phase, "sequential", r * steps, (r + 1) * steps)
                ovl = critical_ranks(report["raw"], phase, "overlap", r * steps, (r + 1) * steps)
                blocked = per_round["a2a_ms_overlap"][r] - max(per_round["compute_extra_ms_overlap"][r], 0.0)
                print(
                    f"{phase:8s} round {r + 1}: hidden {hidden:6.1%}  A_seq {per_round['a2a_ms_sequential'][r]:5.1f}"
                    f"  A_ovl {per_round['a2a_ms_overlap'][r]:5.1f} = blocked {blocked:4.1f}"
                    f" + dC {per_round['compute_extra_ms_overlap'][r]:+5.1f}"
                    f"  ranks' mean {per_round['hidden_fraction_ranks_mean'][r]:6.1%}"
                    f"  critical rank seq {dict(sorted(seq.items()))} ovl {dict(sorted(ovl.items()))}"
                )


if __name__ == "__main__":
    main()
