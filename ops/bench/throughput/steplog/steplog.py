"""Sum FERRY_STEPLOG files (sitecustomize.py here): per file, steps from the first of the burst (> 4
sequences or > 100 prefill tokens), their span, wall and engine-thread CPU per step class (prefill:
steps with prefill tokens or sequences still without a token; decode > 8 / <= 8 sequences) and the
gaps between steps (time the engine thread was not in a step).

    python ops/bench/throughput/steplog/steplog.py /tmp/sl/*
"""

import collections
import sys


def summarize(path: str) -> str:
    rows = []
    for line in open(path):
        start, wall, cpu, outputs, seqs, prefill, thread = line.split()
        rows.append((float(start), float(wall), float(cpu), int(outputs), int(seqs), int(prefill), thread))
    first = next(i for i, r in enumerate(rows) if r[4] > 4 or r[5] > 100)
    rows = rows[first:]
    span = rows[-1][0] + rows[-1][1] - rows[0][0]
    gaps = [b[0] - a[0] - a[1] for a, b in zip(rows, rows[1:])]
    classes: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0, 0.0, 0])
    for r in rows:
        kind = "prefill" if r[5] > 0 or r[3] < r[4] else ("decode>8" if r[4] > 8 else "decode<=8")
        c = classes[kind]
        c[0], c[1], c[2], c[3] = c[0] + 1, c[1] + r[1], c[2] + r[2], c[3] + r[4]
    out = [
        f"{path}: {len(rows)} steps in {span:.2f} s on thread {rows[0][6]}: steps {sum(r[1] for r in rows):.2f} s "
        f"(engine-thread CPU {sum(r[2] for r in rows):.2f} s), gaps {sum(gaps):.2f} s (max {max(gaps) * 1000:.1f} ms)"
    ]
    for kind, (n, wall, cpu, seqs) in sorted(classes.items()):
        out.append(
            f"  {kind:10s} {n:4d} steps, wall {wall:.3f} s ({wall / n * 1000:.2f} ms each), CPU {cpu:.3f} s, "
            f"{seqs / n:.1f} sequences"
        )
    return "\n".join(out)


if __name__ == "__main__":
    for p in sys.argv[1:]:
        print(summarize(p))
