"""How much of a worker's KV transfer time hides behind engine compute: the timeline it is read from.

A worker's engine steps and store calls (put_blocks on the prefill side, get_blocks on the decode
side) are recorded as wall-clock intervals; the hidden fraction is transfer time that overlapped one
of its own engine steps / all its transfer time. ops/bench/prefix/overlap.py wires the services.
"""

from __future__ import annotations

import time

from ferry.kvstore import KvStore


class Timeline:
    def __init__(self) -> None:
        self.steps: list[tuple[float, float]] = []
        self.transfers: list[tuple[float, float]] = []

    def hidden_fraction(self) -> float:
        total = sum(e - s for s, e in self.transfers)
        hidden = sum(_covered(s, e, self.steps) for s, e in self.transfers)
        return hidden / total if total else 0.0

    def summary(self) -> dict:
        return {
            "num_steps": len(self.steps),
            "num_transfers": len(self.transfers),
            "transfer_s": sum(e - s for s, e in self.transfers),
            "step_s": sum(e - s for s, e in self.steps),
            "hidden_fraction": self.hidden_fraction(),
        }


def _covered(start: float, end: float, intervals: list[tuple[float, float]]) -> float:
    """Length of [start, end] inside the union of `intervals` (steps never overlap each other)."""
    return sum(max(0.0, min(end, e) - max(start, s)) for s, e in intervals)


class RecordingStore:
    """The worker's KvStore, with put/get calls timed."""

    def __init__(self, store: KvStore, timeline: Timeline) -> None:
        self.store, self.timeline, self.namespace = store, timeline, store.namespace

    async def _timed(self, coro):
        start = time.perf_counter()
        try:
            return await coro
        finally:
            self.timeline.transfers.append((start, time.perf_counter()))

    async def put_blocks(self, hashes, data):
        return await self._timed(self.store.put_blocks(hashes, data))

    async def get_blocks(self, hashes, *args, **kwargs):
        return await self._timed(self.store.get_blocks(hashes, *args, **kwargs))

    async def lookup(self, hashes):
        return await self.store.lookup(hashes)

    async def num_leading_stored(self, hashes):
        return await self.store.num_leading_stored(hashes)


def record_steps(worker, timeline: Timeline) -> None:
    step = worker.step

    def timed_step():
        start = time.perf_counter()
        try:
            return step()
        finally:
            timeline.steps.append((start, time.perf_counter()))

    worker.step = timed_step
