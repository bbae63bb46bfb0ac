"""EPLB benchmark: max/mean rank load before (contiguous experts, no copies) and after EPLB, on a
skewed routing trace at DeepSeek-V3's expert shape.

    python ops/bench/ep/eplb.py --out ops/bench/ep/reports/<name>

The trace: each step routes `tokens_per_step` hidden states through ferry's own DeepSeek-V3 router
(sigmoid scores, grouped top-k over n_group groups, score-correction bias) with 256 experts in 8
groups, top-8 of 4 groups. The skew: a heavy-tailed (log-normal) correction bias per expert, and
(in the drifting scenario) hidden states whose mean moves over the trace, so the hot set moves.
Placement is computed from the window of past steps and judged on the next `every_steps` steps it
did not see. Writes eplb.json and eplb.png.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from ferry.model.config import ModelConfig
from ferry.model.moe import Router
from ferry.parallel.eplb import ExpertLoadWindow, hierarchical_placement
from ferry.parallel.placement import ExpertPlacement, imbalance


def make_router(args: argparse.Namespace, generator: torch.Generator) -> Router:
    cfg = ModelConfig(
        arch="deepseek_v3", vocab_size=8, hidden_size=args.hidden, num_layers=1, num_heads=1, num_kv_heads=1,
        head_dim=8, intermediate_size=8, max_position_embeddings=8, kv_lora_rank=8, qk_nope_head_dim=8,
        qk_rope_head_dim=8, v_head_dim=8, n_routed_experts=args.experts, num_experts_per_tok=args.top_k,
        n_group=args.groups, topk_group=args.topk_groups, routed_scaling_factor=2.5,
    )  # fmt: skip
    router = Router(cfg)
    with torch.no_grad():
        router.weight.normal_(0, args.router_std, generator=generator)
        bias = torch.randn(args.experts, generator=generator) * args.skew
        router.e_score_correction_bias.copy_(bias - bias.mean())
    return router


def routing_trace(args: argparse.Namespace, drift_scale: float) -> list[list[int]]:
    """Per step: tokens routed to each expert."""
    generator = torch.Generator().manual_seed(args.seed)
    router = make_router(args, generator)
    drift = torch.randn(args.hidden, generator=generator)
    steps = []
    for step in range(args.steps):
        mean = drift * (step / args.steps) * drift_scale
        x = torch.randn(args.tokens_per_step, args.hidden, generator=generator) + mean
        ids, _ = router(x)
        steps.append(torch.bincount(ids.flatten(), minlength=args.experts).tolist())
    return steps


def evaluate(args: argparse.Namespace, trace: list[list[int]]) -> dict:
    contiguous = ExpertPlacement.contiguous(args.experts, args.ranks)
    slots = args.experts // args.ranks + args.redundant_per_rank
    window = ExpertLoadWindow(args.experts, args.window_steps)
    rows = []
    for start in range(0, len(trace) - args.every_steps + 1, args.every_steps):
        if start >= args.window_steps:  # a placement from the past window, judged on the unseen next steps
            ahead = [sum(step[e] for step in trace[start : start + args.every_steps]) for e in range(args.experts)]
            row = {"step": start, "contiguous": imbalance(contiguous.rank_loads(ahead))}
            for name, nodes in (("eplb_hierarchical", args.nodes), ("eplb_global", 1)):
                placement = hierarchical_placement(window.loads(), args.ranks, slots, args.groups, nodes)
                row[name] = imbalance(placement.rank_loads(ahead))
            rows.append(row)
        for step in trace[start : start + args.every_steps]:
            window.record(step)
    return {key: _summary([r[key] for r in rows]) for key in rows[0] if key != "step"} | {"windows": rows}


def _summary(values: list[float]) -> dict:
    return {"mean": sum(values) / len(values), "max": max(values)}


def plot(report: dict, path: Path) -> None:
    from ferry.bench.plots import pyplot

    plt = pyplot()

    shape = report["params"]
    fig, axes = plt.subplots(1, len(report["scenarios"]), figsize=(12, 4), sharey=True)
    for ax, (name, result) in zip(axes, report["scenarios"].items()):
        windows = result["windows"]
        for key, color in (("contiguous", "#c44"), ("eplb_hierarchical", "#48c"), ("eplb_global", "#4a4")):
            ax.plot([w["step"] for w in windows], [w[key] for w in windows], label=key, color=color)
        ax.axhline(1.15, color="#888", linestyle="--", label="target 1.15")
        ax.set_xlabel("step")
        ax.set_title(f"{name}: {shape['experts']} experts, {shape['ranks']} ranks, +{shape['redundant_per_rank']} slot")
    axes[0].set_ylabel("max / mean rank load (next, unseen steps)")
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    for name, default in dict(
        experts=256, groups=8, topk_groups=4, top_k=8, hidden=64, ranks=32, nodes=4, redundant_per_rank=1,
        steps=320, tokens_per_step=1024, window_steps=32, every_steps=16, seed=0,
    ).items():  # fmt: skip
        parser.add_argument(f"--{name.replace('_', '-')}", type=int, default=default)
    parser.add_argument("--skew", type=float, default=0.05, help="std of the per-expert correction bias")
    parser.add_argument("--router-std", type=float, default=0.1, help="std of the router weights")
    parser.add_argument("--drift", type=float, default=0.5, help="how far the hidden-state mean moves (drifting)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    scenarios = {"stationary": 0.0, "drifting": args.drift}
    results = {name: evaluate(args, routing_trace(args, drift)) for name, drift in scenarios.items()}
    report = {"params": vars(args) | {"out": str(args.out)}, "scenarios": results}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "eplb.json").write_text(json.dumps(report, indent=2))
    plot(report, args.out / "eplb.png")
    summary = {name: {k: v for k, v in r.items() if k != "windows"} for name, r in results.items()}
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
