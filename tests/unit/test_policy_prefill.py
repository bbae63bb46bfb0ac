"""Prefill routing: queued tokens and attention work, prefix overlap, overload."""

import pytest
from test_balancing_view import report

from ferry.balancing.view import WorkerView
from ferry_services.prefill_balancer.policy import (
    PrefillPolicyConfig,
    choose_prefill_worker,
    next_mean_prompt_tokens,
    prefill_cost,
    queued_load,
)

pytestmark = pytest.mark.unit
CONFIG = PrefillPolicyConfig(max_queued_tokens=1000, attention_weight=0.0)


def view_of(**queued: int) -> WorkerView:
    view = WorkerView("prefill")
    for worker_id, tokens in queued.items():
        view.update(report(worker_id, num_queued_prefill_tokens=tokens), now=0.0)
    return view


def test_cost_counts_new_tokens_and_causal_pairs():
    assert prefill_cost(10).tokens == 10
    assert prefill_cost(10).attention == 50.0
    cost = prefill_cost(10, num_cached_tokens=4)
    assert (cost.tokens, cost.attention) == (6, (100 - 16) / 2)


def test_fully_cached_prompt_still_computes_its_last_token():
    assert prefill_cost(32, num_cached_tokens=32).tokens == 1
    assert prefill_cost(32, num_cached_tokens=99).tokens == 1


def test_least_queued_worker_wins():
    view = view_of(a=300, b=100, c=200)
    choice = choose_prefill_worker(view.routable(0.0), 50, CONFIG)
    assert (choice.worker_id, choice.reason) == ("b", "")


def test_burst_spreads_over_workers_between_reports():
    view = view_of(a=0, b=0, c=0)
    chosen = []
    for _ in range(6):
        choice = choose_prefill_worker(view.routable(0.0), 100, CONFIG)
        view.note_routed(choice.worker_id, tokens=choice.cost.tokens, attention=choice.cost.attention)
        chosen.append(choice.worker_id)
    assert sorted(chosen) == ["a", "a", "b", "b", "c", "c"]


def test_prefix_overlap_beats_an_equally_loaded_worker():
    view = view_of(a=100, b=100)
    choice = choose_prefill_worker(view.routable(0.0), 200, CONFIG, cached_tokens={"b": 160})
    assert (choice.worker_id, choice.num_cached_tokens, choice.cost.tokens) == ("b", 160, 40)


def test_attention_weight_prefers_many_short_over_one_long_queue():
    config = PrefillPolicyConfig(max_queued_tokens=10**6, attention_weight=1 / 64)
    view = view_of(a=0, b=0)
    view.note_routed("a", tokens=512, attention=prefill_cost(512).attention)
    for _ in range(4):
        view.note_routed("b", tokens=140, attention=prefill_cost(140).attention)
    # b has more tokens queued (560 > 512) but far less attention work
    assert choose_prefill_worker(view.routable(0.0), 64, config).worker_id == "b"


def test_reported_queue_attention_uses_the_mean_prompt_length():
    config = PrefillPolicyConfig(attention_weight=0.5)
    state = view_of(a=100).workers["a"]
    assert queued_load(state, config, mean_prompt_tokens=0) == 100
    assert queued_load(state, config, mean_prompt_tokens=20) == 100 + 0.5 * 100 * 20 / 2


def test_full_workers_mean_overloaded_with_retry_after():
    view = view_of(a=1000, b=1500)
    choice = choose_prefill_worker(view.routable(0.0), 10, CONFIG)
    assert (choice.worker_id, choice.reason, choice.retry_after_s) == (None, "overloaded", 1.0)


def test_work_waiting_in_jetstream_counts_so_backlogged_workers_mean_overloaded():
    """A worker pulls only what fits its next steps; the rest waits in its JetStream queue, which
    its report counts in messages. Without them a backlogged worker looks nearly idle."""
    view = WorkerView("prefill")
    view.update(report("a", num_queued_prefill_tokens=200, num_backlog=9), now=0.0)
    view.update(report("b", num_queued_prefill_tokens=300, num_backlog=1), now=0.0)
    choice = choose_prefill_worker(view.routable(0.0), 10, CONFIG, mean_prompt_tokens=100)
    assert choice.worker_id == "b"  # a: 200 + 9 * 100 queued, b: 300 + 100
    view.update(report("b", num_queued_prefill_tokens=300, num_backlog=7), now=0.0)
    choice = choose_prefill_worker(view.routable(0.0), 10, CONFIG, mean_prompt_tokens=100)
    assert (choice.worker_id, choice.reason) == (None, "overloaded")


def test_one_absurd_prompt_does_not_make_a_single_queued_message_fill_a_worker():
    """Regression (CI, test_faults): a 900k-token prompt published straight onto `ferry.submit`
    moved the uncapped mean to 45k tokens, so every worker with one message in JetStream priced it
    above the cap and normal requests got 429 'overloaded' for the next hundred requests."""
    config = PrefillPolicyConfig()  # max_queued_tokens 32768
    mean = 0.0
    for num_tokens in [200] * 50 + [900_000]:
        mean = next_mean_prompt_tokens(mean, num_tokens, config)
    assert mean < 0.1 * config.max_queued_tokens
    view = WorkerView("prefill")
    view.update(report("a", num_queued_prefill_tokens=200, num_backlog=1), now=0.0)
    assert choose_prefill_worker(view.routable(0.0), 200, config, mean_prompt_tokens=mean).worker_id == "a"


def test_mean_prompt_length_follows_the_traffic():
    mean = 0.0
    for _ in range(200):
        mean = next_mean_prompt_tokens(mean, 300, CONFIG)
    assert mean == pytest.approx(300, rel=1e-3)


def test_idle_worker_takes_a_prompt_longer_than_the_queue_cap():
    view = view_of(a=0)
    assert choose_prefill_worker(view.routable(0.0), 5000, CONFIG).worker_id == "a"


def test_no_workers():
    choice = choose_prefill_worker([], 10, CONFIG)
    assert (choice.worker_id, choice.reason) == (None, "no_workers")


@pytest.mark.parametrize("field,value", [("max_queued_tokens", 0), ("attention_weight", -1.0), ("retry_after_s", 0.0)])
def test_config_rejects_bad_values_naming_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        PrefillPolicyConfig(**{field: value})
