"""`ferry bench --offline --model DIR --ep-size N`: the seeded workload on an N-rank expert-parallel
group (ferry.parallel.group_generate), and how evenly its ranks carried it.

Per rank: the requests whose attention and KV it held (dealt out round-robin), the tokens its
layers computed for them (prompt + output - 1: its attention load), and the token-expert pairs its
routed experts computed (its expert load); for each, max/mean over the ranks (1.0 = perfectly
even). Every request produces exactly its drawn output length (ignore_eos, greedy). Writes
ep_load.json and ep_load.png into the report folder. The elapsed time includes spawning the ranks
and loading the model: context, not a rate.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from ferry.bench.plots import pyplot, save_figure
from ferry.bench.workload import WorkloadConfig, make_workload
from ferry.engine.config import EngineConfig
from ferry.parallel.group_generate import GroupRun, generate_on_group
from ferry.parallel.lockstep import split_round_robin
from ferry.parallel.overlap import MODES
from ferry.parallel.placement import imbalance
from ferry.protocol import SamplingParams

LOADS = ("num_requests", "tokens", "expert_tokens")


def run_ep_load(
    model: Path, workload: WorkloadConfig, out: Path, ep_size: int, mode: str, config: EngineConfig
) -> dict:
    """Runs the workload on the group; -> the report (also written to out)."""
    from ferry.model import read_config

    num_experts = read_config(model).n_routed_experts
    if ep_size < 1 or not num_experts or num_experts % ep_size:
        raise ValueError(f"--ep-size {ep_size}: must divide the model's {num_experts} routed experts")
    if mode not in MODES:
        raise ValueError(f"--ep-mode {mode!r}: expected one of {MODES}")
    requests = make_workload(workload)
    prompts = [{"prompt_token_ids": r.prompt_token_ids, "max_tokens": r.max_tokens} for r in requests]
    sampling = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)  # each prompt sets its own
    start = time.perf_counter()
    run = generate_on_group(model, prompts, sampling, config, ep_size, mode=mode)
    elapsed_s = time.perf_counter() - start
    ranks = rank_loads(run, [len(r.prompt_token_ids) for r in requests], ep_size)
    report = {
        "params": {"model": str(model), "ep_size": ep_size, "mode": mode, "num_requests": len(prompts)},
        "elapsed_s_with_startup": elapsed_s,
        "output_tokens": sum(len(r["token_ids"]) for r in run.results),
        "ranks": ranks,
        "max_over_mean": {load: imbalance([rank[load] for rank in ranks]) for load in LOADS},
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / "ep_load.json").write_text(json.dumps(report, indent=2))
    plot(report, out / "ep_load.png")
    return report


def rank_loads(run: GroupRun, prompt_lens: list[int], ep_size: int) -> list[dict]:
    """Per rank: its requests, the tokens its layers computed for them, the token-expert pairs its
    routed experts computed (for any rank's tokens)."""
    loads = []
    for rank in run.ranks:
        mine = split_round_robin(prompt_lens, rank.rank, ep_size)
        # the last output token is sampled, never fed back: prompt + output - 1 went through the layers
        tokens = sum(prompt_lens[i] + len(run.results[i]["token_ids"]) - 1 for i in mine)
        loads.append(
            {"rank": rank.rank, "num_requests": len(mine), "tokens": tokens, "expert_tokens": rank.expert_tokens}
        )
    return loads


def plot(report: dict, path: Path) -> None:
    plt = pyplot()
    ranks = report["ranks"]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    names = [str(r["rank"]) for r in ranks]
    for ax, load, title in zip(
        axes, ("tokens", "expert_tokens"), ("attention: tokens held", "experts: pairs computed")
    ):
        ax.bar(names, [r[load] for r in ranks], color="#48c")
        ax.set_xlabel("rank")
        ax.set_title(f"{title} (max/mean {report['max_over_mean'][load]:.2f})")
    fig.suptitle(
        f"EP {report['params']['ep_size']}, {report['params']['num_requests']} requests, {report['params']['mode']}"
    )
    save_figure(fig, path)
