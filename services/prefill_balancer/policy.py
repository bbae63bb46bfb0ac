"""Where a new request's prefill goes. Pure: no NATS, no torch.

DeepSeek balances prefill workers by the tokens and the core-attention compute queued on each
(in the engine and, not pulled yet, in the worker's JetStream queue).
A prompt of `n` tokens of which `c` are already cached costs `n - c` tokens of linear work
(projections, MLP) and about (n² - c²)/2 query-key pairs of causal attention; the policy sends the
request to the worker whose queued work *plus this request's cost there* is smallest, so a worker
that holds the prompt's prefix (smaller cost) wins over an equally loaded one without it. A worker
group is weighed per rank, as the seed does: see `group_score`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from ferry.balancing.ranks import rank_views
from ferry.balancing.view import WorkerState


@dataclass(slots=True)
class PrefillPolicyConfig:
    max_queued_tokens: int = 32768
    """A worker with this many prefill tokens queued takes no more; when all are there: 'overloaded'."""
    attention_weight: float = 1.0 / 2048
    """Token-equivalents per query-key pair: at 2048 tokens of context attention costs about as
    much as a token's projections and MLP (a few-hundred-wide model; larger models: smaller)."""
    retry_after_s: float = 1.0
    """What an 'overloaded' reply tells the client to wait."""

    def __post_init__(self) -> None:
        if self.max_queued_tokens < 1:
            raise ValueError(f"max_queued_tokens={self.max_queued_tokens!r} must be >= 1")
        if self.attention_weight < 0:
            raise ValueError(f"attention_weight={self.attention_weight!r} must be >= 0")
        if self.retry_after_s <= 0:
            raise ValueError(f"retry_after_s={self.retry_after_s!r} must be > 0")


@dataclass(slots=True)
class PrefillCost:
    tokens: int
    """New tokens to compute (prompt minus cached prefix)."""
    attention: float
    """Causal query-key pairs of those tokens."""


@dataclass(slots=True)
class PrefillChoice:
    worker_id: str | None
    """None when rejected."""
    reason: str = ""
    """'' when routed; 'overloaded' or 'no_workers'."""
    retry_after_s: float = 0.0
    cost: PrefillCost | None = None
    num_cached_tokens: int = 0


def prefill_cost(num_tokens: int, num_cached_tokens: int = 0) -> PrefillCost:
    """Work to prefill `num_tokens` when the first `num_cached_tokens` are already in a cache."""
    cached = min(max(num_cached_tokens, 0), num_tokens - 1)  # the last token is always computed
    return PrefillCost(tokens=num_tokens - cached, attention=(num_tokens**2 - cached**2) / 2)


PROMPT_EMA = 0.05
"""Weight of each new prompt in the running mean prompt length."""


def next_mean_prompt_tokens(mean: float, num_tokens: int, config: PrefillPolicyConfig) -> float:
    """The running mean prompt length after one more routed prompt of `num_tokens`.

    It prices every message waiting in a JetStream queue, so one sample counts for at most
    `max_queued_tokens` (what one worker may queue at all): an absurd prompt sent straight onto the
    bus would otherwise price each waiting message above the cap and make a worker with a single
    queued message look full ('overloaded') for hundreds of requests."""
    return mean + PROMPT_EMA * (min(num_tokens, config.max_queued_tokens) - mean)


def backlog_tokens(state: WorkerState, mean_prompt_tokens: float = 0.0) -> float:
    """Prompt tokens of the messages waiting in JetStream for the worker: it has not pulled them,
    so its report counts messages, not tokens; each is taken at the recent mean prompt length."""
    return state.report.num_backlog * max(mean_prompt_tokens, 1.0)


def queued_tokens(state: WorkerState, mean_prompt_tokens: float = 0.0) -> float:
    """Prefill tokens ahead of a new request there: in its engine, in its JetStream queue, and
    routed since its report."""
    return state.queued_prefill_tokens + backlog_tokens(state, mean_prompt_tokens)


def group_score(state: WorkerState, config: PrefillPolicyConfig, cost: PrefillCost, mean_prompt_tokens: float) -> float:
    """A worker group's prefill work, per rank (`ferry.balancing.ranks`): tokens + core attention
    queued on each, exact from its report. The prompt lands on one rank (the least loaded one, at
    best); the ranks step in lockstep, so it is done no sooner than the busiest rank's queue."""
    ranks = rank_views(state)
    backlog = backlog_tokens(state, mean_prompt_tokens) / len(ranks)  # not pulled yet: no rank has it
    loads = [
        r.queued_tokens + backlog + config.attention_weight * (r.queued_attention + backlog * mean_prompt_tokens / 2)
        for r in ranks
    ]
    return max(min(loads) + cost.tokens + config.attention_weight * cost.attention, max(loads))


def queued_load(state: WorkerState, config: PrefillPolicyConfig, mean_prompt_tokens: float = 0.0) -> float:
    """A worker's queued prefill work in token-equivalents."""
    # Reports carry queued tokens, not attention pairs: prompts of mean length m hold about
    # m/2 pairs per token. What was routed since the report is known exactly.
    reported_tokens = state.report.num_queued_prefill_tokens + backlog_tokens(state, mean_prompt_tokens)
    attention = reported_tokens * mean_prompt_tokens / 2 + state.routed_attention
    return queued_tokens(state, mean_prompt_tokens) + config.attention_weight * attention


def choose_prefill_worker(
    workers: Sequence[WorkerState],
    num_tokens: int,
    config: PrefillPolicyConfig,
    cached_tokens: Mapping[str, int] | None = None,
    mean_prompt_tokens: float = 0.0,
) -> PrefillChoice:
    """Pick the worker that would finish this prompt's prefill soonest, or say why none can.

    `cached_tokens`: prompt tokens each worker holds cached (prefix overlap), by worker id.
    `mean_prompt_tokens`: recent mean prompt length, to estimate reported queues' attention."""
    if not workers:
        return PrefillChoice(None, "no_workers", config.retry_after_s)
    cached_tokens = cached_tokens or {}
    best: tuple[float, WorkerState, PrefillCost, int] | None = None
    for state in workers:
        if queued_tokens(state, mean_prompt_tokens) >= config.max_queued_tokens:
            continue  # full; an idle worker always qualifies, however long the prompt
        cached = cached_tokens.get(state.worker_id, 0)
        cost = prefill_cost(num_tokens, cached)
        if state.report.ranks:
            score = group_score(state, config, cost, mean_prompt_tokens)
        else:
            score = (
                queued_load(state, config, mean_prompt_tokens) + cost.tokens + config.attention_weight * cost.attention
            )
        if best is None or score < best[0]:
            best = (score, state, cost, cached)
    if best is None:
        return PrefillChoice(None, "overloaded", config.retry_after_s)
    _, state, cost, cached = best
    return PrefillChoice(state.worker_id, cost=cost, num_cached_tokens=cached)
