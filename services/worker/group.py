"""A worker that is an expert-parallel group (`FERRY_EP_SIZE=N` > 1): building it, showing its ranks,
and failing it cleanly.

The worker process is rank 0 (`ferry.parallel.serving_group.GroupEngine`): the NATS-facing worker
whose engine is the whole group. Its micro metadata names the ranks' pids, its micro stats and load
reports carry one `RankLoad` per rank.

A rank that dies fails the group at once: the ranks left are killed, every request held is given
back to its gateway (`worker_lost`, retryable: the gateway resubmits prompt + tokens so far, so its
client sees one stream) and its message acked (no stale copy runs when the group comes back), after
one last load report saying it drains (so the balancers route none of the resubmissions back here),
and the process exits with GROUP_FAILED_EXIT: to the balancers and gateways the worker is lost.
An orchestrator restarts it; the restarted group serves again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from typing import Any

from ferry.protocol import RankLoad

log = logging.getLogger(__name__)

GROUP_FAILED_EXIT = 3
GIVE_BACK_TIMEOUT_S = 2.0
"""Most time a failing group spends telling gateways before it exits."""


def start_group(settings: Any, config: Any) -> Any:
    """Spawn and load the group (slow: on the engine thread, which its ranks' lifetime is tied to)."""
    from dataclasses import replace

    from ferry.parallel.serving_group import GroupEngine

    config = replace(config, host_cache_blocks=0)  # no host tier in a group yet
    try:
        return GroupEngine.start(settings.model, config, settings.ep_size)
    except ValueError as exc:  # e.g. ep_size does not divide the experts, or a dense model
        raise SystemExit(f"ferry worker: FERRY_EP_SIZE {settings.ep_size}: {exc}") from None


def is_group(engine: Any) -> bool:
    return hasattr(engine, "rank_stats")


def group_metadata(engine: Any) -> dict[str, str]:
    """The micro metadata of a group: its size and its ranks' pids, rank 0 first."""
    if not is_group(engine):
        return {}
    return {"ep_size": str(engine.ep_size), "rank_pids": ",".join(map(str, engine.pids))}


def rank_loads(engine: Any) -> list[RankLoad]:
    """One RankLoad per rank of a group (read on the asyncio thread: snapshots only); [] otherwise."""
    if not is_group(engine):
        return []
    cap = engine.local.max_num_seqs
    return [
        RankLoad(
            rank=rank,
            num_running=stats.num_running,
            num_waiting=stats.num_waiting,
            num_queued_prefill_tokens=stats.num_queued_prefill_tokens,
            queued_prefill_attention=attention,
            kv_blocks_used=stats.kv_blocks_used,
            kv_blocks_total=stats.kv_blocks_total,
            max_running=cap,
        )
        for rank, (stats, attention) in enumerate(zip(list(engine.rank_stats), list(engine.rank_attention)))
    ]


def watch_group(worker: Any) -> None:
    """Fail the worker as soon as one of its ranks ends (see the module docstring)."""
    loop = asyncio.get_running_loop()

    def on_failure(reason: str) -> None:
        loop.call_soon_threadsafe(lambda: loop.create_task(fail_group(worker, reason)))

    worker.engine.watch(on_failure)


async def fail_group(worker: Any, reason: str) -> None:
    log.error("worker group %s failed: %s; its requests go back to their gateways", worker.worker_id, reason)
    worker.engine.kill_ranks()
    held = worker.ledger.release_all()
    with contextlib.suppress(Exception):
        await asyncio.wait_for(_give_back(worker, held, reason), GIVE_BACK_TIMEOUT_S)
    log.error("worker group %s: %d requests given back; exiting", worker.worker_id, len(held))
    logging.shutdown()
    os._exit(GROUP_FAILED_EXIT)  # the engine thread may be stuck in a collective with the dead rank


async def _give_back(worker: Any, held: list, reason: str) -> None:
    worker.ledger.draining = True  # a last report first: the balancers route no resubmission here
    await worker.publish_report()
    await worker.nc.flush()
    for h in held:
        await worker.publish_error(h.request, "worker_lost", f"{worker.worker_id}: {reason}", retryable=True)
        if h.handle is not None:
            with contextlib.suppress(Exception):
                await h.handle.ack()
    await worker.nc.flush()
