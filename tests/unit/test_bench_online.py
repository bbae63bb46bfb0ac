"""ferry.bench.online: the workload as HTTP calls and arrival schedules, without a server."""

from __future__ import annotations

import math

import pytest

from ferry.bench.online import ids_to_text, make_calls, make_plans, parse_rates
from ferry.bench.workload import WorkloadConfig

pytestmark = pytest.mark.unit


def test_poisson_schedule_is_reproducible_from_the_seed():
    first = make_plans([math.inf, 2.0, 8.0], num_requests=400, seed=7)
    again = make_plans([math.inf, 2.0, 8.0], num_requests=400, seed=7)
    assert [p.arrivals_s for p in first] == [p.arrivals_s for p in again]
    assert first[1].arrivals_s != make_plans([2.0], num_requests=400, seed=8)[0].arrivals_s
    assert [p.name for p in first] == ["all-at-once", "poisson-2rps", "poisson-8rps"]
    assert first[0].arrivals_s == [0.0] * 400
    for plan in first[1:]:
        gaps = [b - a for a, b in zip(plan.arrivals_s, plan.arrivals_s[1:])]
        assert min(gaps) >= 0
        assert sum(gaps) / len(gaps) == pytest.approx(1 / plan.rate_rps, rel=0.15)  # 399 exponential gaps


def test_calls_follow_the_workload():
    workload = WorkloadConfig(num_requests=20, seed=1, shared_prefix_len=40)
    ids = make_calls(workload, "ids")
    assert [c.index for c in ids] == list(range(20))
    assert all(c.num_prompt_tokens == len(c.prompt) for c in ids)
    assert {tuple(c.prompt[:40]) for c in ids} == {tuple(ids[0].prompt[:40])}  # the shared prefix
    texts = make_calls(workload, "text")
    assert [c.max_tokens for c in texts] == [c.max_tokens for c in ids]
    assert all(len(t.prompt.split()) == c.num_prompt_tokens - 1 for t, c in zip(texts, ids))
    with pytest.raises(ValueError, match="prompt_format"):
        make_calls(workload, "bytes")


def test_text_prompts_keep_their_length_in_the_bench_tokenizer():
    from ferry.model.bpe_tokenizer import train_tokenizer

    tokenizer = train_tokenizer(2048)  # what `ferry make-model` writes (BOS added by the server)
    for ids in ([5] * 16, list(range(16, 116)), list(range(500, 1524))):
        assert len(tokenizer.encode(ids_to_text(ids)).ids) == len(ids)


def test_parse_rates():
    assert parse_rates("inf, 1,2.5") == [math.inf, 1.0, 2.5]
    for bad in ("", "0", "fast", "-1"):
        with pytest.raises(ValueError, match="--rates"):
            parse_rates(bad)
