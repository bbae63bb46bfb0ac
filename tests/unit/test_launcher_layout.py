"""`ferry up --layout`: which workers it starts and how many torch threads each gets (pure planning)."""

from __future__ import annotations

import argparse

import pytest

from ferry.launcher.up import add_arguments, plan_services, resolve_layout

pytestmark = pytest.mark.unit


@pytest.fixture(autouse=True)
def no_omp_env(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(list(argv))


def workers(args: argparse.Namespace) -> list[tuple[str, str]]:
    specs = plan_services(args, "/m", "nats://n", "redis://r")
    return [(s.env["FERRY_ROLE"], s.env["OMP_NUM_THREADS"]) for s in specs if s.kind == "worker"]


def test_auto_runs_one_worker_of_both_roles_with_every_core_on_a_small_machine():
    args = parse()
    resolve_layout(args, num_cores=2)
    assert args.layout == "both" and workers(args) == [("both", "2")]


def test_auto_splits_on_a_big_machine_or_when_worker_counts_are_given():
    args = parse()
    resolve_layout(args, num_cores=16)
    assert args.layout == "split" and workers(args) == [("prefill", "8"), ("decode", "8")]
    args = parse("--prefill-workers", "2", "--decode-workers", "1")
    resolve_layout(args, num_cores=2)
    assert workers(args) == [("prefill", "1"), ("prefill", "1"), ("decode", "1")]  # never below one thread


def test_threads_and_layout_asked_for_are_kept():
    args = parse("--layout", "both", "--workers", "2", "--torch-threads", "3")
    resolve_layout(args, num_cores=2)
    assert workers(args) == [("both", "3"), ("both", "3")]
    args = parse("--layout", "split")
    resolve_layout(args, num_cores=2)
    assert workers(args) == [("prefill", "1"), ("decode", "1")]


def test_omp_num_threads_of_the_caller_is_kept(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    args = parse()
    resolve_layout(args, num_cores=2)
    assert workers(args) == [("both", "1")]


def test_services_without_a_model_run_one_thread():
    args = parse("--layout", "split")
    resolve_layout(args, num_cores=8)
    specs = plan_services(args, "/m", "nats://n", "redis://r")
    assert {s.env["OMP_NUM_THREADS"] for s in specs if s.kind != "worker"} == {"1"}


def test_worker_counts_of_the_other_layout_are_refused():
    with pytest.raises(SystemExit, match="--layout split"):
        resolve_layout(parse("--layout", "both", "--decode-workers", "2"), num_cores=2)
    with pytest.raises(SystemExit, match=">= 1"):
        resolve_layout(parse("--layout", "both", "--workers", "0"), num_cores=2)


def test_ep_size_makes_every_worker_a_group_and_shares_the_cores_among_its_ranks():
    args = parse("--layout", "split", "--ep-size", "2")
    resolve_layout(args, num_cores=8)
    specs = [s for s in plan_services(args, "/m", "nats://n", "redis://r") if s.kind == "worker"]
    assert [(s.env["FERRY_EP_SIZE"], s.env["OMP_NUM_THREADS"]) for s in specs] == [("2", "2"), ("2", "2")]
    args = parse()
    resolve_layout(args, num_cores=8)
    assert all("FERRY_EP_SIZE" not in s.env for s in plan_services(args, "/m", "nats://n", "redis://r"))


def test_prefill_and_decode_groups_can_differ_and_the_cores_follow_the_ranks():
    args = parse("--layout", "split", "--decode-ep-size", "4")
    resolve_layout(args, num_cores=10)  # 1 prefill rank + 4 decode ranks: 2 threads each
    specs = [s for s in plan_services(args, "/m", "nats://n", "redis://r") if s.kind == "worker"]
    got = {s.env["FERRY_ROLE"]: (s.env.get("FERRY_EP_SIZE"), s.env["OMP_NUM_THREADS"]) for s in specs}
    assert got == {"prefill": (None, "2"), "decode": ("4", "2")}
    args = parse("--layout", "split", "--ep-size", "2", "--prefill-ep-size", "1")
    resolve_layout(args, num_cores=8)
    specs = [s for s in plan_services(args, "/m", "nats://n", "redis://r") if s.kind == "worker"]
    assert {s.env["FERRY_ROLE"]: s.env.get("FERRY_EP_SIZE") for s in specs} == {"prefill": None, "decode": "2"}


def test_role_group_sizes_are_refused_where_they_cannot_apply():
    with pytest.raises(SystemExit, match="--decode-ep-size is for --layout split"):
        resolve_layout(parse("--layout", "both", "--decode-ep-size", "2"), num_cores=2)
    with pytest.raises(SystemExit, match=">= 1"):
        resolve_layout(parse("--layout", "split", "--prefill-ep-size", "0"), num_cores=2)


@pytest.mark.parametrize("cores, argv, nice", [(2, [], 5), (8, [], 0), (2, ["--support-nice", "0"], 0)])
def test_support_processes_yield_the_cores_to_workers_on_a_small_machine(cores, argv, nice):
    args = parse(*argv)
    resolve_layout(args, num_cores=cores)
    specs = plan_services(args, "/m", "nats://n", "redis://r")
    assert {s.nice for s in specs if s.kind == "worker"} == {0}
    assert {s.nice for s in specs if s.kind != "worker"} == {nice}


STREAM, WRITEBACK = "FERRY_STREAM_INTERVAL_MS", "FERRY_KV_WRITEBACK_DELAY_S"


@pytest.mark.parametrize(
    "var, cores, argv, env, value",
    [
        # a small machine: workers send a stream's tokens in 50 ms bunches
        (STREAM, 2, [], None, "50.0"),
        (STREAM, 8, [], None, "0.0"),
        (STREAM, 2, ["--stream-interval-ms", "0"], None, "0.0"),
        (STREAM, 8, [], "5", "5.0"),
        # one worker of layout both: nobody else reads its write-backs soon, so they wait behind its work
        (WRITEBACK, 2, [], None, "5.0"),
        (WRITEBACK, 2, ["--workers", "2"], None, "0.0"),
        (WRITEBACK, 8, [], None, "0.0"),  # split
        (WRITEBACK, 2, ["--kv-writeback-delay-s", "0"], None, "0.0"),
        (WRITEBACK, 2, [], "1.5", "1.5"),
    ],
)
def test_worker_defaults_follow_the_machine_and_give_way_to_flags_and_env(monkeypatch, var, cores, argv, env, value):
    if env is None:
        monkeypatch.delenv(var, raising=False)
    else:
        monkeypatch.setenv(var, env)
    args = parse(*argv)
    resolve_layout(args, num_cores=cores)
    specs = plan_services(args, "/m", "nats://n", "redis://r")
    assert {s.env[var] for s in specs if s.kind == "worker"} == {value}
    assert all(var not in s.env for s in specs if s.kind != "worker")
