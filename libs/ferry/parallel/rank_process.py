"""The rank-process side of a serving group (serving_group.GroupEngine is rank 0's side): a rank
joins the group, loads its share of the model and an engine of its own, then runs each call rank 0
sends over its pipe and replies with the result and a snapshot of its load, until told to close.
It dies with rank 0 however rank 0 ends (no orphaned rank holding a collective open).
"""

from __future__ import annotations

import os
from multiprocessing.connection import Connection
from typing import Any

from ferry.engine.config import EngineConfig
from ferry.engine.outputs import EngineStats


def queued_attention(engine: Any) -> float:
    """Causal query-key pairs the engine's unfinished prefills still have to compute: a prompt of
    n tokens with c computed costs about (n^2 - c^2) / 2 (the prefill balancer's measure)."""
    sched = engine.scheduler
    pending = [s for s in (*sched.running, *sched.waiting) if not s.is_prefill_done]
    return sum((s.num_tokens**2 - s.num_computed_tokens**2) / 2 for s in pending)


def snapshot(engine: Any) -> tuple[EngineStats, float]:
    """What every reply carries: the engine's stats and its queued prefill attention."""
    return engine.stats(), queued_attention(engine)


def rank_main(rank: int, ep_size: int, address: Any, model: str, config: EngineConfig, conn: Connection) -> None:
    """A rank process: join the group, load its share, then run what rank 0 sends until told to stop."""
    _die_with_parent()
    from ferry.parallel.lockstep import init_group, load_rank_engine

    init_group(address, rank, ep_size, config.device)
    engine = load_rank_engine(model, config, rank, ep_size)
    conn.send(("ok", None, snapshot(engine)))
    while True:
        try:
            method, args = conn.recv()
        except EOFError:  # rank 0 is gone
            os._exit(1)
        if method == "close":
            os._exit(0)  # no barrier: rank 0 may already be on its way out
        try:
            reply = ("ok", getattr(engine, method)(*args), snapshot(engine))
        except (ValueError, KeyError, RuntimeError) as exc:  # a refused call: rank 0 raises it
            reply = ("error", exc, snapshot(engine))
        conn.send(reply)


def _die_with_parent() -> None:
    """Linux: this rank gets SIGKILL when the thread that spawned it ends (rank 0's engine thread,
    which lives as long as the worker), however rank 0 ends."""
    import ctypes
    import signal
    import sys

    if sys.platform == "linux":
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
