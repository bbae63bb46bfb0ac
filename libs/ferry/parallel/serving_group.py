"""A serving worker's expert-parallel group, seen by the worker as one engine (`FERRY_EP_SIZE=N`).

Rank 0 is the worker process itself: it holds rank 0's share of the model and engine and spawns
ranks 1..N-1, each holding its own share, its own KV pool and scheduler (attention data-parallel).
Rank 0 deals every new sequence to the rank that suits it best (`dealing.py`: batch fill + KV
usage), remembers which rank holds it, and sends that rank every later call about it. A step is
every rank's step at once: the ranks meet in each MoE layer's all-to-all (`torch.distributed`,
gloo on CPU, NCCL on GPU), a rank with nothing scheduled still steps, and rank 0 collects every
rank's outputs. Control travels over one pipe per rank, used only from the engine thread; each
reply carries the rank's stats, so loads per rank are known without asking again.

A rank that dies fails the group: the watchdog (a thread waiting on the ranks' process sentinels)
calls `on_failure` at once, even while rank 0 is stuck in a collective with the dead rank; a call
that finds a rank's pipe closed raises GroupFailed. What the worker does then is its business
(services/worker/group.py: give its requests back and exit non-zero). The ranks' side of the
pipes: rank_process.py.
"""

from __future__ import annotations

import logging
import os
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, fields
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any

from ferry.engine.config import EngineConfig
from ferry.engine.outputs import EngineStats
from ferry.parallel.dealing import RankState, ranks_by_preference
from ferry.parallel.group_generate import GroupFailed
from ferry.parallel.rank_process import queued_attention, rank_main, snapshot

log = logging.getLogger(__name__)

MAX_FINISHED_OWNERS = 4096
"""Finished sequences whose rank is remembered (take_finished_kv asks for them after they end)."""


@dataclass(slots=True)
class RankLink:
    rank: int
    process: Any
    """A multiprocessing Process (spawned)."""
    conn: Connection


class GroupEngine:
    def __init__(self, local: Any, links: list[RankLink], stats: list[tuple[EngineStats, float]]) -> None:
        self.local = local
        """Rank 0's own LLMEngine."""
        self.links = links
        self.ep_size = len(links) + 1
        self.rank_stats = [local.stats(), *(s for s, _ in stats)]
        """Each rank's EngineStats after its latest call (read from any thread)."""
        self.rank_attention = [queued_attention(local), *(a for _, a in stats)]
        """Each rank's queued prefill attention (query-key pairs) after its latest call."""
        self.owner: dict[str, int] = {}
        """Rank of every sequence in the group (finished ones too until taken or forgotten)."""
        self.unfinished: set[str] = set()
        self._finished: OrderedDict[str, None] = OrderedDict()
        self._chosen: int | None = None
        """The rank can_admit found room on, for the add_prefilled that follows it."""
        self.is_closing = False

    # ---- start, watch, stop ------------------------------------------------------------------
    @classmethod
    def start(cls, model: str | Path, config: EngineConfig, ep_size: int) -> GroupEngine:
        """Spawn ranks 1..ep_size-1, join the group as rank 0 and load every rank's share (slow)."""
        import torch.multiprocessing as mp

        from ferry.parallel.lockstep import GroupAddress, check_group_config, init_group, load_rank_engine

        check_group_config(config, ep_size)
        ctx = mp.get_context("spawn")
        address = GroupAddress.free_local()
        links = []
        for rank in range(1, ep_size):
            parent, child = ctx.Pipe()
            process = ctx.Process(target=rank_main, args=(rank, ep_size, address, str(model), config, child))
            process.daemon = True
            process.start()
            child.close()
            links.append(RankLink(rank, process, parent))
        try:
            init_group(address, 0, ep_size, config.device)
            local = load_rank_engine(model, config, 0, ep_size)
            stats = [link.conn.recv()[2] for link in links]  # ('ok', None, stats) once loaded
        except BaseException:
            for link in links:
                link.process.kill()
            raise
        return cls(local, links, stats)

    @property
    def pids(self) -> list[int]:
        """Process id of every rank, rank 0 first."""
        return [os.getpid(), *(link.process.pid for link in self.links)]

    def watch(self, on_failure: Callable[[str], None]) -> None:
        """Call on_failure(reason) (on a thread of its own) as soon as a rank process ends."""
        threading.Thread(target=self._watch, args=(on_failure,), name="ferry-group-watch", daemon=True).start()

    def _watch(self, on_failure: Callable[[str], None]) -> None:
        by_sentinel = {link.process.sentinel: link for link in self.links}
        ended = wait(list(by_sentinel))
        if self.is_closing:
            return
        link = by_sentinel[ended[0]]
        link.process.join(1.0)
        on_failure(f"rank {link.rank} (pid {link.process.pid}) exited with {link.process.exitcode}")

    def kill_ranks(self) -> None:
        for link in self.links:
            if link.process.is_alive():
                link.process.kill()

    def close(self) -> None:
        """Stop every rank (the worker is exiting)."""
        self.is_closing = True
        for link in self.links:
            try:
                link.conn.send(("close", ()))
            except OSError:
                pass
        for link in self.links:
            link.process.join(5.0)
        self.kill_ranks()
        import torch.distributed as dist

        if dist.is_initialized():  # local to rank 0: no collective with ranks that are gone
            dist.destroy_process_group()

    # ---- calls -------------------------------------------------------------------------------
    def _on(self, rank: int, method: str, *args: Any) -> Any:
        """method(*args) on one rank's engine; its exception re-raised here."""
        if rank == 0:
            try:
                return getattr(self.local, method)(*args)
            finally:
                self.rank_stats[0], self.rank_attention[0] = snapshot(self.local)
        link = self.links[rank - 1]
        self._send(link, method, args)
        return self._recv(link)

    def _on_all(self, method: str, *args: Any) -> list[Any]:
        """method(*args) on every rank at once (a step: the ranks meet in its collectives)."""
        for link in self.links:
            self._send(link, method, args)
        try:
            values = [self._on(0, method, *args)]
        finally:
            values += [self._recv(link) for link in self.links]  # keeps every pipe in step, even on error
        return values

    def _send(self, link: RankLink, method: str, args: tuple) -> None:
        try:
            link.conn.send((method, args))
        except OSError as exc:
            raise GroupFailed(f"rank {link.rank} is gone ({exc})") from None

    def _recv(self, link: RankLink) -> Any:
        try:
            reply = link.conn.recv()
        except (EOFError, OSError) as exc:
            raise GroupFailed(f"rank {link.rank} is gone ({type(exc).__name__})") from None
        status, value, (self.rank_stats[link.rank], self.rank_attention[link.rank]) = reply
        if status == "error":
            raise value
        return value

    # ---- the engine interface the workers use ------------------------------------------------
    @property
    def lm(self) -> Any:
        return self.local.lm

    @property
    def config(self) -> EngineConfig:
        return self.local.config

    @property
    def kv_namespace(self) -> str:
        return self.local.kv_namespace

    @property
    def kv_cache_dtype(self) -> str:
        return self.local.kv_cache_dtype

    @property
    def tokenizer(self) -> Any:
        return self.local.tokenizer

    host = None
    """No host tier in a group (yet): EngineConfig.host_cache_blocks is 0 on every rank."""

    @property
    def max_num_seqs(self) -> int:
        """The group's cap: every rank's cap together."""
        return self.local.max_num_seqs * self.ep_size

    def warmup(self) -> None:
        self._on_all("warmup")

    def remember_finished(self, max_sequences: int) -> None:
        self._on_all("remember_finished", max_sequences)

    def has_unfinished_requests(self) -> bool:
        return bool(self.unfinished)

    def step(self) -> list:
        outputs = [out for outs in self._on_all("step") for out in outs]
        for out in outputs:
            if out.finish_reason is not None:
                self._finish(out.request_id)
        return outputs

    def can_admit(self, num_tokens: int) -> bool:
        """Room on some rank; the add_prefilled that follows goes there."""
        num_blocks = -(-(num_tokens + 1) // self.config.block_size)
        for rank in ranks_by_preference(self.rank_states(), num_blocks):
            if self._on(rank, "can_admit", num_tokens):
                self._chosen = rank
                return True
        return False

    def add_request(self, request_id: str, prompt_token_ids: list[int], *args: Any, **kwargs: Any) -> None:
        num_tokens = len(prompt_token_ids) + len(args[1] if len(args) > 1 and args[1] else ())
        self._add(request_id, self._deal(num_tokens), "add_request", prompt_token_ids, *args, **kwargs)

    def add_prefilled(self, request_id: str, prompt_token_ids: list[int], *args: Any, **kwargs: Any) -> None:
        rank, self._chosen = self._chosen, None
        if rank is None:
            rank = self._deal(len(prompt_token_ids) + len(args[0]))
        self._add(request_id, rank, "add_prefilled", prompt_token_ids, *args, **kwargs)

    def _add(self, request_id: str, rank: int, method: str, *args: Any, **kwargs: Any) -> None:
        if kwargs:  # over the pipe, arguments travel by position
            args = (*args, *kwargs.values())
        self._on(rank, method, request_id, *args)
        self.owner[request_id] = rank
        self.unfinished.add(request_id)

    def _deal(self, num_tokens: int) -> int:
        return ranks_by_preference(self.rank_states(), -(-(num_tokens + 1) // self.config.block_size))[0]

    def abort_request(self, request_id: str) -> Any:
        rank = self.owner.pop(request_id, None)
        self.unfinished.discard(request_id)
        self._finished.pop(request_id, None)
        return None if rank is None else self._on(rank, "abort_request", request_id)

    def take_running(self, request_id: str) -> Any:
        rank = self.owner.pop(request_id)  # KeyError when not here, as LLMEngine says
        self.unfinished.discard(request_id)
        return self._on(rank, "take_running", request_id)

    def take_prefilled(self, request_id: str) -> Any:
        self._finished.pop(request_id, None)
        return self._on(self.owner.pop(request_id), "take_prefilled", request_id)

    def take_finished_kv(self, request_id: str, skip_blocks: int = 0) -> Any:
        rank = self.owner.get(request_id)
        return None if rank is None else self._on(rank, "take_finished_kv", request_id, skip_blocks)

    def take_finished_chain(self, request_id: str, skip_blocks: int = 0) -> Any:
        """(chain, OutCopy, partial block name) from the rank that held it (an OutCopy crosses the pipe landed)."""
        rank = self.owner.get(request_id)
        return None if rank is None else self._on(rank, "take_finished_chain", request_id, skip_blocks)

    def stage_kv(self, data: Any) -> Any:
        """Any thread: fetched blocks stay on the host, for whichever rank the sequence is dealt to."""
        return data

    def _finish(self, request_id: str) -> None:
        self.unfinished.discard(request_id)
        self._finished[request_id] = None
        while len(self._finished) > MAX_FINISHED_OWNERS:
            self.owner.pop(self._finished.popitem(last=False)[0], None)

    def drain_kv_events(self) -> tuple[list[bytes], list[bytes]]:
        return _merge(self._on_all("drain_kv_events"))

    def drain_host_events(self) -> tuple[list[bytes], list[bytes]]:
        return _merge(self._on_all("drain_host_events"))

    def cached_hashes(self) -> tuple[list[bytes], list[bytes]]:
        return _merge(self._on_all("cached_hashes"))

    def cached_tiers(self, block_hashes: list[bytes]) -> tuple[int, int]:
        """Read off the engine thread, so it cannot ask the ranks: a group claims nothing cached,
        and a prefill fetches what the store holds (the rank's own cache still hits at admission)."""
        return 0, 0

    def num_cached_blocks(self, block_hashes: list[bytes]) -> int:
        return 0

    # ---- load --------------------------------------------------------------------------------
    def rank_states(self) -> list[RankState]:
        per_rank_cap = self.local.max_num_seqs
        return [
            RankState(s.num_running + s.num_waiting, per_rank_cap, s.kv_blocks_used, s.kv_blocks_total)
            for s in self.rank_stats
        ]

    def stats(self) -> EngineStats:
        """The group's totals; steps are the group's (every rank takes each one)."""
        ranks = list(self.rank_stats)
        total = EngineStats(**{f.name: sum(getattr(s, f.name) for s in ranks) for f in fields(EngineStats)})
        total.num_steps = ranks[0].num_steps
        return total


def _merge(parts: list[tuple[list[bytes], list[bytes]]]) -> tuple[list[bytes], list[bytes]]:
    """Every rank's (stored, removed) block hashes: the group holds what any rank holds."""
    return [h for stored, _ in parts for h in stored], [h for _, removed in parts for h in removed]
