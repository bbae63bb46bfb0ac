"""trace.py's pure parts: the worker's hops read the same in either layout, and the `ferry up` command it
starts leaves the layout to ferry up unless told."""

from __future__ import annotations

from pathlib import Path

import pytest

from ferry.bench.system.run import system_command
from ferry.bench.system.trace import per_request, worker_hop, workers_of

pytestmark = pytest.mark.unit


def test_worker_hops_of_both_layouts_share_one_name():
    assert worker_hop("pw.step_start") == worker_hop("bw.step_start") == "w.step_start"
    assert worker_hop("dw.step_start") == "dw.step_start"  # the decode worker's steps are not the first token's
    assert worker_hop("gw.sse") == "gw.sse"


def _lines(role: str) -> list[dict]:
    rows = [("r1", "gw.http", 1.0), ("r1", f"{role}.pulled", 1.1), ("r1", "pw.prefix", 1.2)]
    rows += [("*", f"{role}.step_start", 1.0), ("*", f"{role}.step_start", 1.3), ("*", f"{role}.step_end", 1.5)]
    rows += [("r1", f"{role}.published", 1.6), ("r1", "gw.event", 1.7)]
    return [{"rid": rid, "hop": hop, "t": t} for rid, hop, t in rows]


@pytest.mark.parametrize("role", ["pw", "bw"])
def test_the_first_tokens_step_is_found_in_either_layout(role):
    stamps = [{"client.send": 0.9, "client.write": 0.95, "client.first": 1.8, "engine_ttft_s": None}]
    (hops,) = per_request(_lines(role), stamps)
    assert (hops["w.step_start"], hops["w.step_end"]) == (1.3, 1.5)  # the step after the prefix, not before
    assert hops["w.published"] == 1.6 and hops["w.pulled"] == 1.1


def _command(layout: str) -> list[str]:
    workers = workers_of(layout)
    workers.torch_threads = 0
    return system_command(Path("m.gguf"), 8000, Path("/tmp/run"), workers)


def test_auto_leaves_the_layout_to_ferry_up():
    cmd = _command("auto")
    assert "--prefill-workers" not in cmd and "--decode-workers" not in cmd and "--layout" not in cmd
    assert "--torch-threads" not in cmd


def test_split_and_both_are_passed_on():
    split = _command("split")
    assert split[split.index("--prefill-workers") + 1] == "1" and split[split.index("--decode-workers") + 1] == "1"
    both = _command("both")
    assert both[both.index("--layout") + 1] == "both" and "--prefill-workers" not in both
