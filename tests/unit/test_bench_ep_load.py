"""`ferry bench --offline --ep-size N`: the workload runs on an expert-parallel group and the report
accounts for every token on some rank: requests dealt out round-robin, each token computed by
exactly top-k experts in every MoE layer, summed over the ranks."""

import argparse
import json

import pytest

from ferry.bench import cli
from ferry.model import read_config
from ferry.model.make_model import make_model

pytestmark = [pytest.mark.unit, pytest.mark.slow]  # spawns 2 rank processes


def bench(*argv) -> int:
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    return cli.run(parser.parse_args(list(argv)))


def test_ep_bench_reports_each_ranks_load(tmp_path, capsys):
    model = make_model(tmp_path / "ds", "deepseek-v3", "tiny")
    common = ["--offline", "--model", str(model), "--num-requests", "7", "--max-prompt-len", "64"]
    out = tmp_path / "report"
    assert bench(*common, "--output-lens", "4,8", "--ep-size", "2", "--ep-mode", "overlap", "--out", str(out)) == 0
    report = json.loads((out / "ep_load.json").read_text())
    assert (out / "ep_load.png").stat().st_size > 0
    ranks = report["ranks"]
    assert [r["num_requests"] for r in ranks] == [4, 3]
    cfg = read_config(model)
    moe_layers = cfg.num_layers - cfg.first_k_dense_replace
    tokens = sum(r["tokens"] for r in ranks)
    assert sum(r["expert_tokens"] for r in ranks) == tokens * cfg.num_experts_per_tok * moe_layers
    expert_loads = [r["expert_tokens"] for r in ranks]
    assert report["max_over_mean"]["expert_tokens"] == pytest.approx(max(expert_loads) / (sum(expert_loads) / 2))
    assert json.loads(capsys.readouterr().out)["ranks"] == ranks


def test_ep_size_must_divide_the_routed_experts(tmp_path, capsys):
    model = make_model(tmp_path / "ds", "deepseek-v3", "tiny")
    assert bench("--offline", "--model", str(model), "--ep-size", "3", "--out", str(tmp_path / "r")) == 2
    assert "--ep-size 3: must divide the model's 8 routed experts" in capsys.readouterr().err
