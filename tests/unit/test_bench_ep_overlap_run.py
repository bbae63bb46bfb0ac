"""The overlap benchmark's run: its random checkpoint (~285 MB at the default size) lives in a
temporary folder that is gone after the run, whether the ranks finished or failed; and a whole small
run (two spawned gloo ranks that end with leave_group(exit_process=True)) writes its report."""

from __future__ import annotations

import json
import sys
import tempfile

import pytest

from ferry.bench import ep_overlap

pytestmark = pytest.mark.unit

SMALL = "--model-size tiny --prefill-seqs 2 --prefill-len 8 --decode-seqs 4 --decode-context 8 --rounds 1"
FEW = "--prefill-warmup 0 --prefill-steps 2 --decode-warmup 0 --decode-steps 2"


def checkpoints(folder) -> list:
    return [path for path in folder.iterdir() if path.name.startswith("ferry-ep-bench")]


@pytest.fixture
def own_tmp(tmp_path, monkeypatch):
    folder = tmp_path / "tmp"
    folder.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(folder))
    return folder


def test_the_checkpoint_is_deleted_when_a_rank_fails(own_tmp, monkeypatch, tmp_path):
    seen = []

    def failing_spawn(fn, args, nprocs):
        seen.extend(path / "ds" for path in checkpoints(own_tmp) if (path / "ds").is_dir())  # there while ranks run
        raise RuntimeError("rank 1 died")

    monkeypatch.setattr(ep_overlap.mp, "spawn", failing_spawn)
    monkeypatch.setattr(sys, "argv", ["overlap", "--out", str(tmp_path / "out"), *SMALL.split()])
    with pytest.raises(RuntimeError, match="rank 1 died"):
        ep_overlap.main()
    assert len(seen) == 1
    assert checkpoints(own_tmp) == []


@pytest.mark.slow
def test_a_small_run_writes_its_report_and_leaves_nothing_in_tmp(own_tmp, monkeypatch, tmp_path):
    out = tmp_path / "out"
    monkeypatch.setattr(sys, "argv", ["overlap", "--out", str(out), *SMALL.split(), *FEW.split()])
    ep_overlap.main()
    report = json.loads((out / "overlap.json").read_text())
    assert len(report["raw"]) == 2 and set(report["result"]) >= {"prefill", "decode"}
    assert (out / "overlap.png").exists()
    assert checkpoints(own_tmp) == []
