"""SLO-aware admission: which queued prompts can still meet their TTFT target, and how much a step
may stall the running decodes without breaking their TPOT target. Pure Python, no I/O.

On time (`on_time_order`): every queued prompt must be prefilled by its deadline, arrival + a
share of the TTFT target. Prefill is one machine working through the queue, so the most prompts
that finish by their deadlines is what the Moore-Hodgson rule gives: take the prompts in deadline
order (= arrival order: every request has the same target), and whenever the one just added would
finish late, drop the longest taken so far (maybe itself). The dropped are late whatever happens;
they go behind the others instead of making the others late too (first come, first served lets
one hopeless 700-token prompt push every prompt behind it past its deadline). They still run,
after those that can make it.

TPOT slack (`tpot_slack_ms`): a request meets the TPOT target when the time from its first token
to its last is at most target x (tokens after the first). Each running decode knows its first
token time, how many tokens it has made and (at most) how many remain, so after the remaining
steps at the plain decode pace its slack is what it can still give up: the extra time one step
may take beyond a decode step before the tightest live request breaks (decodes already past
saving do not count: protecting them buys nothing).

Seats beyond the cap (`seats_to_add`): the cap is a plan for the steady state; a prompt that it
keeps waiting for a seat while admitting it now would meet its TTFT target gets a seat anyway
when that keeps the running requests' TPOT (`num_losing_tpot`: whose slack the longer steps use
up), or when it loses fewer of them than it saves: the goodput counts each request once.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence
from dataclasses import dataclass


@dataclass(slots=True, frozen=True)
class QueuedPrompt:
    key: str
    arrival_s: float
    num_tokens: int
    """Tokens still to prefill."""


@dataclass(slots=True, frozen=True)
class RunningDecode:
    key: str
    first_token_s: float
    num_after_first: int
    """Tokens made since the first one."""
    num_remaining: int
    """Tokens still to come (at most: max_tokens left)."""


def on_time_order(
    queue: Sequence[QueuedPrompt],
    now_s: float,
    deadline_s: float,
    prefill_ms: Callable[[int], float],
    head_ms: float = 0.0,
) -> tuple[list[QueuedPrompt], list[QueuedPrompt]]:
    """(on time in arrival order, late in arrival order). deadline_s: how long after its arrival a
    prompt's prefill must end; prefill_ms(tokens): how long prefilling that many tokens takes at
    the current pace; head_ms: work ahead of the whole queue (prompts already mid-prefill)."""
    ordered = sorted(queue, key=lambda p: p.arrival_s)  # stable: equal arrivals keep queue order
    taken: list[tuple[float, int]] = []  # (-cost, -position): the longest, latest on ties, on top
    costs = [prefill_ms(p.num_tokens) for p in ordered]
    late: set[int] = set()
    end_ms = now_s * 1000.0 + head_ms
    for i, prompt in enumerate(ordered):
        heapq.heappush(taken, (-costs[i], -i))
        end_ms += costs[i]
        if end_ms > (prompt.arrival_s + deadline_s) * 1000.0:
            _, longest = heapq.heappop(taken)
            end_ms -= costs[-longest]
            late.add(-longest)
    on_time = [p for i, p in enumerate(ordered) if i not in late]
    return on_time, [p for i, p in enumerate(ordered) if i in late]


def tpot_slack_ms(
    running: Sequence[RunningDecode], now_s: float, tpot_ms: float, decode_step_ms: float
) -> float | None:
    """The extra time (ms) the next step may take beyond a decode step before the tightest running
    request that can still meet the TPOT target no longer can; None: no running request can (or
    none runs), nothing to protect."""
    slacks = [s for s in _live_slacks(running, now_s, tpot_ms, decode_step_ms) if s >= 0]
    return min(slacks) if slacks else None


def num_losing_tpot(
    running: Sequence[RunningDecode], now_s: float, tpot_ms: float, decode_step_ms: float, extra_step_ms: float
) -> int:
    """How many running requests that can still meet the TPOT target would not if every step from
    now to their end took extra_step_ms longer (what more sequences in the batch cost)."""
    return sum(
        0 <= slack < extra_step_ms * d.num_remaining
        for d, slack in zip(_live(running), _live_slacks(running, now_s, tpot_ms, decode_step_ms))
    )


def seats_to_add(
    held: Sequence[QueuedPrompt],
    now_s: float,
    deadline_s: float,
    seat_wait_ms: float,
    prefill_ms: Callable[[int], float],
    num_broken: Callable[[int], int],
    fits_tpot: Callable[[int], bool],
) -> int:
    """Seats beyond the cap for the first k of `held` (prompts the cap keeps waiting, in admission
    order): the k that saves the most requests. A held prompt is saved when waiting seat_wait_ms
    for a seat and then its prefill would end past arrival + deadline_s and admitting it now would
    not. k costs num_broken(k) running requests their TPOT target; fits_tpot(k): the newcomers'
    own decode steps meet it (else they miss the TPOT target anyway). Adding seats pays when the
    TTFT misses it saves outnumber the TPOT misses it causes (each is one request lost); 0 when
    nothing pays, the smallest k among equal gains."""
    now_ms, best, best_gain, saved = now_s * 1000.0, 0, 0, 0
    for k, prompt in enumerate(held, 1):
        saved += now_ms + seat_wait_ms + prefill_ms(prompt.num_tokens) > (prompt.arrival_s + deadline_s) * 1000.0
        if not fits_tpot(k):
            break
        if saved - num_broken(k) > best_gain:
            best, best_gain = k, saved - num_broken(k)
    return best


def _live(running: Sequence[RunningDecode]) -> list[RunningDecode]:
    return [d for d in running if d.num_remaining > 0]


def _live_slacks(running: Sequence[RunningDecode], now_s: float, tpot_ms: float, decode_step_ms: float) -> list[float]:
    """Per running request with tokens to come: its slack (module doc); negative: past saving."""
    return [
        tpot_ms * (d.num_after_first + d.num_remaining)
        - (now_s - d.first_token_s) * 1000.0
        - d.num_remaining * decode_step_ms
        for d in _live(running)
    ]
