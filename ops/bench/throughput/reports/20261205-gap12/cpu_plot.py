"""The twelfth round's accounting as a picture: CPU seconds per process (ferry up) against the in-process
engine under the SmolLM2 burst, and the step timelines' wall per step class (steplog-cpu.txt).

    python ops/bench/throughput/reports/20261205-gap12/cpu_plot.py
"""

import json
import re
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

HERE = Path(__file__).parent


def step_classes(text: str) -> list[dict[str, float]]:
    """Per steplog file (engine first, then the worker): wall s per step class and the gaps."""
    out = []
    for block in re.split(r"\n(?=/tmp/)", text[text.index("/tmp/") :]):
        row = {"gaps": float(re.search(r"gaps ([\d.]+) s", block).group(1))}
        for kind, wall in re.findall(r"(decode<=8|decode>8|prefill)\s+\d+ steps, wall ([\d.]+) s", block):
            row[kind] = float(wall)
        out.append(row)
    return out


def main() -> None:
    up = json.loads((HERE / "steplog-cpu.json").read_text())
    engine_line = (HERE / "steplog-cpu.txt").read_text().splitlines()[0]
    engine_cpu = float(re.search(r"CPU ([\d.]+) s", engine_line).group(1))
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    worker = up["thread_cpu_s"]["worker-both-0"]
    parts = {"worker: engine + OpenMP threads": sum(v for k, v in worker.items() if v > 1.0)}
    parts["worker: asyncio thread"] = sum(v for k, v in worker.items() if v <= 1.0)
    for name, cpu in sorted(up["cpu_s"].items(), key=lambda kv: -kv[1]):
        if not name.startswith("worker"):
            parts[name.rsplit("-", 1)[0] if name[-1].isdigit() else name] = cpu
    bottom = 0.0
    for name, value in parts.items():
        left.bar("ferry up", value, bottom=bottom, label=f"{name} {value:.2f}")
        bottom += value
    left.bar("engine in-process", engine_cpu, color="grey", label=f"engine process {engine_cpu:.2f}")
    left.set_ylabel("CPU seconds during the 48-request burst")
    left.set_ylim(0, 34)
    left.legend(fontsize=7, loc="upper right", ncol=2)
    left.set_title("CPU per process (SmolLM2 Q4_1, 2 cores)", fontsize=9)
    engine, worker_steps = step_classes((HERE / "steplog-cpu.txt").read_text())
    kinds = ["prefill", "decode>8", "decode<=8", "gaps"]
    xs = range(len(kinds))
    right.bar([x - 0.2 for x in xs], [engine[k] for k in kinds], 0.4, label="engine in-process")
    right.bar([x + 0.2 for x in xs], [worker_steps[k] for k in kinds], 0.4, label="ferry up's worker")
    right.set_xticks(list(xs), kinds)
    right.set_ylabel("wall seconds")
    right.set_title("step timeline per step class (same call)", fontsize=9)
    right.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(HERE / "cpu.png", dpi=110)


if __name__ == "__main__":
    main()
