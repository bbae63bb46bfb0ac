"""The command lines the harnesses share: `--systems` parsing and the `ferry up` argv (used by the
compare and throughput harnesses and by the e2e system tests)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from ferry.bench.compare.servers import ferry_up_argv, parse_systems
from ferry.cli import build_parser

pytestmark = pytest.mark.unit


def test_systems_keep_their_order_and_refuse_unknown_or_none():
    assert parse_systems(" b, a ,,", ("a", "b", "c")) == ["b", "a"]
    for text in ("a,d", "", " , "):
        with pytest.raises(SystemExit, match="choose from"):
            parse_systems(text, ("a", "b"))


def test_ferry_up_argv_parses_as_ferry_up_with_the_extra_options(tmp_path: Path):
    argv = ferry_up_argv("smollm2", 8123, tmp_path, "--layout", "both", "--weights-dtype", "float32")
    assert argv[:4] == [sys.executable, "-m", "ferry.cli", "up"]
    args = build_parser(argv[3:]).parse_args(argv[3:])
    assert (args.model, args.port, Path(args.run_dir)) == ("smollm2", 8123, tmp_path)
    assert (args.layout, args.weights_dtype) == ("both", "float32")
