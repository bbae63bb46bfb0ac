"""The balancers' worker view: reports in, silent workers out, routed work counted in between."""

import pytest
from reports import load_report

from ferry.balancing.view import WorkerView
from ferry.protocol import LoadReport

pytestmark = pytest.mark.unit


def report(worker_id="w1", role="prefill", interval_s=1.0, **kw) -> LoadReport:
    fields = {"timestamp": 0.0, "kv_blocks_total": 100, "max_running": 8, **kw}
    return load_report(worker_id, role, interval_s=interval_s, **fields)


def test_reported_workers_are_routable_sorted_by_id():
    view = WorkerView("prefill")
    view.update(report("b"), now=0.0)
    view.update(report("a"), now=0.0)
    assert [s.worker_id for s in view.routable(now=0.5)] == ["a", "b"]


def test_worker_silent_past_its_intervals_leaves_routing_once_and_comes_back():
    view = WorkerView("prefill", silent_after_intervals=3)
    view.update(report("a", interval_s=1.0), now=0.0)
    view.update(report("b", interval_s=10.0), now=0.0)
    assert view.expire(now=2.9) == []
    assert view.expire(now=3.5) == ["a"]  # a's 3 s are up, b's 30 s are not
    assert view.expire(now=4.0) == []  # named once
    assert [s.worker_id for s in view.routable(now=4.0)] == ["b"]
    assert view.silent_ids == {"a"}
    view.update(report("a", interval_s=1.0), now=5.0)
    assert [s.worker_id for s in view.routable(now=5.0)] == ["a", "b"]
    assert view.silent_ids == set()


def test_silent_worker_is_not_routable_even_before_expire_runs():
    view = WorkerView("decode")
    view.update(report("a", role="decode"), now=0.0)
    assert view.routable(now=10.0) == []


def test_draining_worker_is_not_routable():
    view = WorkerView("prefill")
    view.update(report("a", draining=True), now=0.0)
    view.update(report("b"), now=0.0)
    assert [s.worker_id for s in view.routable(now=0.0)] == ["b"]


def test_routed_work_adds_to_the_report_until_the_next_report():
    view = WorkerView("decode")
    view.update(report("a", role="decode", num_running=2, kv_blocks_used=10), now=0.0)
    view.note_routed("a", tokens=5, blocks=3)
    view.note_routed("a", blocks=4)
    state = view.workers["a"]
    assert (state.num_seqs, state.kv_blocks_used, state.kv_blocks_free) == (4, 17, 83)
    view.update(report("a", role="decode", num_running=4, kv_blocks_used=17), now=0.5)
    state = view.workers["a"]
    assert (state.num_seqs, state.kv_blocks_used, state.routed_tokens) == (4, 17, 0)


def test_routing_to_an_unknown_worker_is_ignored():
    view = WorkerView("prefill")
    view.note_routed("ghost", tokens=10)
    assert view.workers == {}


def test_model_match_is_preferred_else_every_worker_qualifies():
    view = WorkerView("prefill")
    view.update(report("a", model="llama"), now=0.0)
    view.update(report("b", model="qwen"), now=0.0)
    assert [s.worker_id for s in view.routable(0.0, model="qwen")] == ["b"]
    assert [s.worker_id for s in view.routable(0.0, model="other")] == ["a", "b"]


def test_report_of_the_other_role_is_refused():
    view = WorkerView("prefill")
    with pytest.raises(ValueError, match="role='decode'"):
        view.update(report("a", role="decode"), now=0.0)


def test_silent_threshold_must_exceed_one_interval():
    with pytest.raises(ValueError, match="silent_after_intervals"):
        WorkerView("prefill", silent_after_intervals=1)


def test_the_view_and_the_policies_import_no_nats_redis_or_torch():
    """The deciding half of balancing stays pure, however the I/O half next to it grows."""
    import subprocess
    import sys

    modules = [
        "ferry.balancing.view",
        "ferry_services.prefill_balancer.policy",
        "ferry_services.prefill_balancer.prefix_index",
        "ferry_services.decode_balancer.policy",
    ]
    code = f"import sys, {', '.join(modules)}; print([m for m in ('nats', 'redis', 'torch') if m in sys.modules])"
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert loaded.strip() == "[]"
