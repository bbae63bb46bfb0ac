"""Multi-turn chat workload for `ferry bench --multi-turn`: seeded conversations driven over HTTP.

Every user shares one system prompt and takes `num_turns` turns: a user message (log-normal length),
an answer of `output_len` tokens, then a think time (exponential) before the next turn. Turn k's
prompt is the whole conversation so far (system prompt + every earlier message and answer, as token
ids: the answer's ids come back with `return_token_ids`) plus the new message, so turn k's KV is the
prefix of turn k+1's. Users start spread over one mean think time and run side by side.
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass, field

import httpx

from ferry.bench.http_client import CompletionCall, build_body, stream_completion
from ferry.bench.workload import latency_summary


@dataclass(slots=True)
class ConversationConfig:
    num_users: int = 8
    num_turns: int = 4
    system_prompt_len: int = 256
    user_len_median: int = 48
    output_len: int = 64
    think_time_s: float = 1.0
    """Mean pause between an answer and the user's next message."""
    vocab_size: int = 2048
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("num_users", "num_turns", "system_prompt_len", "user_len_median", "output_len", "vocab_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"ConversationConfig.{name}={getattr(self, name)!r}: must be >= 1")
        if self.think_time_s < 0:
            raise ValueError(f"ConversationConfig.think_time_s={self.think_time_s!r}: must be >= 0")


@dataclass(slots=True)
class Conversation:
    """One user's script: when it starts, its messages and its think times."""

    user: int
    start_s: float
    messages: list[list[int]]
    think_s: list[float]


def make_conversations(config: ConversationConfig) -> tuple[list[int], list[Conversation]]:
    """(system prompt, conversations); the same for every system under test."""
    rng = random.Random(config.seed)
    token = lambda: rng.randrange(3, config.vocab_size)  # noqa: E731 (ids 0..2: special tokens)
    system = [token() for _ in range(config.system_prompt_len)]
    conversations = []
    for user in range(config.num_users):
        # one message more than num_turns: the turn run after the workers restart
        lengths = [_user_len(rng, config.user_len_median) for _ in range(config.num_turns + 1)]
        messages = [[token() for _ in range(n)] for n in lengths]
        think = [rng.expovariate(1 / config.think_time_s) if config.think_time_s else 0.0 for _ in messages]
        start = rng.uniform(0, config.think_time_s)
        conversations.append(Conversation(user, start, messages, think))
    return system, conversations


def _user_len(rng: random.Random, median: int) -> int:
    return max(4, min(int(rng.lognormvariate(0, 0.5) * median), 4 * median))


@dataclass(slots=True)
class TurnResult:
    user: int
    turn: int
    """1-based index of the turn in its conversation."""
    num_prompt_tokens: int
    ok: bool
    ttft_s: float | None = None
    e2e_s: float | None = None
    num_output_tokens: int = 0
    error: str | None = None
    request_id: str | None = None
    """The server's id of the completion (its SSE events' `id`): joins a hop trace (multiturn_trace.py)."""
    sent_at: float = 0.0
    """Wall clock (unix s) when the request was sent."""


@dataclass(slots=True)
class Session:
    """Where each user's conversation stands between phases."""

    history: dict[int, list[int]] = field(default_factory=dict)


async def run_turns(
    base_url: str,
    model: str,
    config: ConversationConfig,
    conversations: list[Conversation],
    system: list[int],
    session: Session,
    turns: range,
    timeout_s: float = 120.0,
) -> tuple[list[TurnResult], float]:
    """Run turns `turns` (0-based message indices) of every conversation; (results, wall seconds)."""
    results: list[TurnResult] = []
    start = time.perf_counter()
    async with httpx.AsyncClient(timeout=timeout_s) as client:
        await asyncio.gather(
            *(
                _user(client, base_url, model, config, c, system, session, turns, results, start, timeout_s)
                for c in conversations
            )
        )
    return results, time.perf_counter() - start


async def _user(client, base_url, model, config, conv, system, session, turns, results, start, timeout_s) -> None:
    await asyncio.sleep(max(0.0, conv.start_s - (time.perf_counter() - start)) if turns.start == 0 else 0.0)
    for k in turns:
        prompt = session.history.get(conv.user, system) + conv.messages[k]
        call = CompletionCall(
            index=conv.user, prompt=prompt, max_tokens=config.output_len, num_prompt_tokens=len(prompt)
        )
        body = {**build_body(call, model, "extra"), "return_token_ids": True}
        token_ids: list[int] = []
        ids: list[str] = []
        sent_at = time.time()
        result = await stream_completion(
            client, f"{base_url}/v1/completions", body, call, 0.0, timeout_s, on_event=_collect_ids(token_ids, ids)
        )
        results.append(
            TurnResult(
                conv.user,
                k + 1,
                len(prompt),
                result.ok,
                result.ttft_s,
                result.e2e_s,
                result.num_output_tokens,
                result.error,
                ids[0] if ids else None,
                sent_at,
            )
        )
        if not result.ok:
            return  # a broken conversation: its later turns would not share its history
        session.history[conv.user] = prompt + token_ids
        await asyncio.sleep(conv.think_s[k])


def _collect_ids(token_ids: list[int], request_ids: list[str]):
    def on_event(event: dict) -> None:
        if not request_ids and event.get("id"):
            request_ids.append(event["id"])
        for choice in event.get("choices") or []:
            token_ids.extend(choice.get("token_ids") or ())

    return on_event


def summarize(results: list[TurnResult], wall_s: float) -> dict:
    """TTFT p50/p99 per turn index, and output throughput."""
    by_turn: dict[int, list[float]] = {}
    for r in results:
        if r.ok and r.ttft_s is not None:
            by_turn.setdefault(r.turn, []).append(r.ttft_s)
    later = [t for turn, values in by_turn.items() if turn >= 2 for t in values]
    num_tokens = sum(r.num_output_tokens for r in results if r.ok)
    return {
        "ttft_ms_by_turn": {str(turn): latency_summary(values) for turn, values in sorted(by_turn.items())},
        "ttft_ms_turn_2_on": latency_summary(later),
        "num_turns_ok": sum(r.ok for r in results),
        "num_errors": sum(not r.ok for r in results),
        "errors": sorted({r.error for r in results if r.error})[:5],
        "wall_s": wall_s,
        "output_tokens_per_s": num_tokens / wall_s if wall_s else 0.0,
        "e2e_ms": latency_summary([r.e2e_s for r in results if r.ok and r.e2e_s is not None]),
    }
