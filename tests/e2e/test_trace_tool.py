"""ops/bench/system/trace.py on a GGUF file, as on SmolLM2: it asks for the model by the name the gateway
serves (no '.gguf'; the file name got a 404) and traces the layout `ferry up` picks on its own."""

from __future__ import annotations

import subprocess
import sys

import gguf
import pytest
from gguf_files import checkpoint_to_gguf

from ferry.model.make_model import make_model

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def test_trace_runs_on_a_gguf_file(tmp_path):
    ckpt = make_model(tmp_path / "ckpt", "llama", "tiny", seed=3)
    path = checkpoint_to_gguf(ckpt, tmp_path / "tiny.Q8_0.gguf", gguf.GGMLQuantizationType.Q8_0)
    argv = [sys.executable, "-m", "ferry.bench.system.trace", "--model", str(path), "--requests", "3"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    rows = {line.split()[0] for line in done.stdout.splitlines() if line.strip()}
    assert {"w.pulled", "w.step_start", "w.step_end", "w.published", "gw.sse"} <= rows  # every hop was stamped
    assert "client TTFT median" in done.stdout
