"""`ferry bench --multi-turn`: the whole system (`ferry up`'s processes) with KV prefetch off, then on,
on one nats-server and one redis-server, driven by the same seeded conversations (multiturn.py).

'off' is ferry without the multi-turn KV features (no host tier, no decode write-back, no prefetch);
Each mode: start the services, run `num_turns` turns of every conversation, then
restart the decode worker (`--restart decode`, the default: its pool and host tier gone, Redis still holding
blocks) or every worker (`--restart all`) and run one more turn. Before turn 1, and again before that
last turn, a warm-up (`--warmup-users` unrelated one-turn conversations, not counted) pays the fresh
processes' first-request costs, so that both modes' turn 1 (and last turn) start from the same state.
The report has TTFT p50/p99 per turn, throughput, and the prefill worker's prompt blocks per tier.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

from ferry.bench.multiturn import ConversationConfig, Session, make_conversations, run_turns, summarize
from ferry.bench.multiturn_report import write_markdown, write_plot
from ferry.bench.multiturn_trace import turn_breakdowns
from ferry.launcher import servers
from ferry.launcher.up import plan_services, spawn, stop_children, wait_ready

MODES = {
    "off": {"FERRY_HOST_KV_BLOCKS": "0", "FERRY_KV_WRITEBACK": "false", "FERRY_KV_PREFETCH": "false"},
    "on": {"FERRY_HOST_KV_BLOCKS": "512", "FERRY_KV_WRITEBACK": "true", "FERRY_KV_PREFETCH": "true"},
}
WARMUP_SEED_OFFSET = 1_000_003
"""The warm-up's conversations: the bench's seed plus this, so they share no tokens' blocks with the measured ones."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    m = parser.add_argument_group("multi-turn bench (--multi-turn: starts the system itself, prefetch off vs on)")
    m.add_argument("--multi-turn", action="store_true", help="run the multi-turn conversation bench")
    m.add_argument("--users", type=int, default=8, help="conversations running at once (default %(default)s)")
    m.add_argument(
        "--turns", type=int, default=4, help="turns per conversation, each re-sending the history (default %(default)s)"
    )
    m.add_argument(
        "--system-prompt-len",
        type=int,
        default=256,
        help="tokens of the system prompt every conversation starts with, the same for all users (default %(default)s)",
    )
    m.add_argument(
        "--user-len-median",
        type=int,
        default=48,
        help="median tokens of a user message (log-normal, seeded by --seed; default %(default)s)",
    )
    m.add_argument(
        "--turn-output-len", type=int, default=64, help="tokens each answer decodes (ignore_eos; default %(default)s)"
    )
    m.add_argument(
        "--think-time-s",
        type=float,
        default=1.0,
        help="mean of a user's pause (exponential) between an answer and the next turn (default %(default)s)",
    )
    m.add_argument(
        "--restart",
        choices=("decode", "all"),
        default="decode",
        help="which workers restart before the last turn (default %(default)s)",
    )
    m.add_argument(
        "--warmup-users",
        type=int,
        default=4,
        help="before turn 1 of each mode and again before the turn after the restart, this many unrelated "
        "one-turn conversations (own tokens: no shared prefix), so both modes start with warm processes; "
        "0: none (default %(default)s)",
    )
    m.add_argument(
        "--trace-hops",
        action="store_true",
        help="stamp every service's hops (FERRY_TRACE_FILE, one file per mode in its logs folder) and report "
        "where each turn's TTFT went (multiturn_trace.py)",
    )
    m.add_argument(
        "--prefill-kv-blocks", type=int, default=1024, help="the prefill worker's pool (default %(default)s)"
    )


def run_multiturn(args: argparse.Namespace, out: Path) -> int:
    from ferry.model.make_model import make_model

    out.mkdir(parents=True, exist_ok=True)
    model = Path(args.model) if args.model else make_model(out / "model", "llama", "bench")
    config = ConversationConfig(
        num_users=args.users,
        num_turns=args.turns,
        system_prompt_len=args.system_prompt_len,
        user_len_median=args.user_len_median,
        output_len=args.turn_output_len,
        think_time_s=args.think_time_s,
        vocab_size=args.vocab_size or json.loads((model / "config.json").read_text())["vocab_size"],
        seed=args.seed,
    )
    report: dict = {"config": _fields(config), "modes": {}}
    report["config"]["model"] = str(model)
    report["config"]["prefill_kv_blocks"] = args.prefill_kv_blocks
    report["config"]["restart"] = args.restart
    report["config"]["warmup_users"] = args.warmup_users
    report["command"] = " ".join(["ferry", *sys.argv[1:]]) if "bench" in sys.argv else ""
    with contextlib.ExitStack() as stack:
        nats = stack.enter_context(servers.start_nats())
        redis = stack.enter_context(servers.start_redis())
        for mode in MODES:
            report["modes"][mode] = _run_mode(mode, model, config, nats.url, redis.url, args, out / f"logs-{mode}")
            print(f"ferry bench --multi-turn: {mode}: {json.dumps(report['modes'][mode]['turns']['ttft_ms_by_turn'])}")
    report["ratios"] = _ratios(report["modes"])
    (out / "multiturn.json").write_text(json.dumps(report, indent=1))
    write_markdown(out / "README.md", report)
    write_plot(out / "ttft_by_turn.png", report)
    print(f"ferry bench --multi-turn: report in {out}")
    return 0


def _fields(config) -> dict:
    return {name: getattr(config, name) for name in config.__slots__}


def _run_mode(mode, model, config, nats_url, redis_url, args, run_dir: Path) -> dict:
    import redis as redis_sync

    redis_sync.Redis.from_url(redis_url).flushall()  # each mode starts with an empty store
    run_dir.mkdir(parents=True, exist_ok=True)
    ns = argparse.Namespace(
        prefill_workers=1,
        decode_workers=1,
        num_kv_blocks=None,
        weights_dtype=getattr(args, "weights_dtype", None),
        max_running=args.max_num_seqs,
        max_batch_tokens=None,
        torch_threads=1,  # six processes share the machine
        host="127.0.0.1",
        port=servers.free_port(),
    )
    specs = plan_services(ns, model, nats_url, redis_url)
    trace_file = run_dir / "hops.jsonl"
    for spec in specs:
        spec.env.update(MODES[mode])
        if args.trace_hops:
            spec.env["FERRY_TRACE_FILE"] = str(trace_file)
        if spec.env.get("FERRY_ROLE") == "prefill":
            spec.env["FERRY_NUM_KV_BLOCKS"] = str(args.prefill_kv_blocks)
    children = [spawn(spec, run_dir) for spec in specs]
    base_url = f"http://127.0.0.1:{ns.port}"
    try:
        _ready(children, base_url)
        result: dict = {}
        warm_tiers: dict = {}
        if args.warmup_users:
            result["warmup"] = _warm_up(base_url, _model_name(model), config, args.warmup_users)
            warm_tiers = asyncio.run(_tier_stats(nats_url))
        system, conversations = make_conversations(config)
        session = Session()
        turns, wall_s = asyncio.run(
            run_turns(base_url, _model_name(model), config, conversations, system, session, range(config.num_turns))
        )
        result["turns"] = summarize(turns, wall_s)
        tiers = asyncio.run(_tier_stats(nats_url))  # the measured turns' share only: less the warm-up's
        result["prefix_blocks_by_tier"] = {tier: n - warm_tiers.get(tier, 0) for tier, n in tiers.items()}
        for child in [c for c in children if _restarts(c.spec, args.restart)]:  # pools, host tiers gone; Redis kept
            stop_children([child])
            children[children.index(child)] = spawn(child.spec, run_dir)
        _ready(children, base_url)
        # the prefill worker's counters: this turn's share only (they kept running unless it restarted too)
        baseline = tiers if args.restart != "all" else {}
        if args.warmup_users:  # the restarted processes' first-request costs, not this turn's, as before turn 1
            result["warmup_after_restart"] = _warm_up(base_url, _model_name(model), config, args.warmup_users, 2)
            baseline = asyncio.run(_tier_stats(nats_url))
        last = range(config.num_turns, config.num_turns + 1)
        after, after_wall_s = asyncio.run(
            run_turns(base_url, _model_name(model), config, conversations, system, session, last)
        )
        result["after_restart"] = summarize(after, after_wall_s)
        after_tiers = asyncio.run(_tier_stats(nats_url))
        result["after_restart"]["prefix_blocks_by_tier"] = {
            tier: n - baseline.get(tier, 0) for tier, n in after_tiers.items()
        }
        if args.trace_hops:
            result["hops"] = turn_breakdowns(trace_file, turns, after)
        return result
    finally:
        stop_children(children)


def _warm_up(base_url: str, model_name: str, config: ConversationConfig, num_users: int, nth: int = 1) -> dict:
    """One turn of `num_users` conversations of the same shape from another seed (another system prompt: no
    block in common with the measured ones), all at once: the first requests' one-off costs (imports, first
    kernels, allocations) are paid here in each mode, not in its turn 1."""
    warm = replace(config, num_users=num_users, seed=config.seed + nth * WARMUP_SEED_OFFSET, think_time_s=0.0)
    system, conversations = make_conversations(warm)
    results, wall_s = asyncio.run(run_turns(base_url, model_name, warm, conversations, system, Session(), range(1)))
    summary = summarize(results, wall_s)
    if summary["num_errors"]:
        raise RuntimeError(f"warm-up failed: {summary['errors']}")
    return summary


def _restarts(spec, which: str) -> bool:
    return spec.kind == "worker" and (which == "all" or spec.env.get("FERRY_ROLE") == "decode")


def _ready(children, base_url: str) -> None:
    problem = wait_ready(children, base_url, 300.0)
    if problem:
        raise RuntimeError(f"system not ready: {problem}")


def _model_name(model: Path) -> str:
    return model.name


async def _tier_stats(nats_url: str) -> dict:
    """The prefill worker's admitted prompt blocks by tier, from `nats micro stats prefill-worker`, and under
    `partial_tokens` the tokens it copied from cached partial last blocks instead of computing them."""
    from ferry.bus import connect

    nc = await connect(nats_url, "ferry-bench")
    try:
        reply = await nc.request("$SRV.STATS.prefill-worker", b"", timeout=5)
    finally:
        await nc.close()
    stats = json.loads(reply.data)
    work = next(e for e in stats["endpoints"] if e["name"] == "work")
    tiers = dict(work["data"].get("prefix_blocks_by_tier", {}))
    tiers["partial_tokens"] = work["data"].get("num_partial_hit_tokens", 0)
    return tiers


def _ratios(modes: dict) -> dict:
    """off / on for TTFT (> 1: 'on' is faster), on / off for throughput (>= 1: no loss)."""
    off, on = modes["off"], modes["on"]

    def ratio(a, b):
        return a / b if a and b else None

    by_turn = {
        turn: ratio(off["turns"]["ttft_ms_by_turn"].get(turn, {}).get("p50"), stats["p50"])
        for turn, stats in on["turns"]["ttft_ms_by_turn"].items()
    }
    later = "ttft_ms_turn_2_on"
    return {
        "ttft_p50_off_over_on_by_turn": by_turn,
        "ttft_p50_off_over_on_turn_2_on": ratio(off["turns"][later]["p50"], on["turns"][later]["p50"]),
        "ttft_p50_off_over_on_after_restart": ratio(
            off["after_restart"][later]["p50"], on["after_restart"][later]["p50"]
        ),
        "throughput_on_over_off": ratio(on["turns"]["output_tokens_per_s"], off["turns"]["output_tokens_per_s"]),
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
