"""ops/gpu/check.sh, the one-shot GPU check: it parses, and its dry mode (the CPU, the tiny model, tiny
workloads) runs the checkpoint, decode-bandwidth, KV-copy and bench steps end to end and writes summary.json."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.ops, pytest.mark.slow]
ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "ops" / "gpu" / "check.sh"


def test_the_script_parses():
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)


@pytest.mark.skipif(shutil.which("timeout") is None, reason="needs coreutils timeout")
def test_a_dry_run_writes_every_step_and_the_summary(tmp_path):
    env = {**os.environ, "OUT": str(tmp_path), "PYTHON": sys.executable}
    done = subprocess.run(
        ["bash", str(SCRIPT), "--dry", "--steps", "model,decode,kvcopy,bench"],
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert done.returncode == 0, done.stderr[-2000:]
    assert summary["ok"] and summary["dry"] and set(summary["steps"]) == {"model", "decode", "kvcopy", "bench"}
    assert [run["batch"] for run in summary["decode"]] == [1, 4]
    assert all(run["host_sync_in_forward"] is None and run["achieved_gb_s"] > 0 for run in summary["decode"])
    assert all(run["graph_step_ms"] is None for run in summary["decode"])  # no CUDA graphs on the CPU
    assert summary["kvcopy"]["byte_identical"] and summary["kvcopy"]["overlap"] is None  # synchronous on the CPU
    assert summary["bench"]["ratios"]["dynamic_vs_static_output_tokens_per_s"] > 0
    assert not (tmp_path / "model-tiny").exists()  # the checkpoint is not brought back
