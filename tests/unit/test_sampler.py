"""Sampler on plain tensors: each knob changes what a user would see, and seeds are batch-proof."""

import math

import pytest
import torch
from host_sync import watch_host_syncs

from ferry.engine.sampler import SampleRequest, sample
from ferry.protocol import SamplingParams

pytestmark = pytest.mark.unit
V = 32


def req(prompt=(1,), output=(), blocked=(), **kw):
    return SampleRequest(SamplingParams(**kw), list(prompt) + list(output), len(prompt), tuple(blocked))


def logits_rows(n, seed=0):
    return torch.randn(n, V, generator=torch.Generator().manual_seed(seed))


def test_greedy_is_argmax():
    logits = logits_rows(4)
    result = sample(logits, [req(temperature=0) for _ in range(4)])
    assert result.token_ids == logits.argmax(-1).tolist()
    assert result.logprobs == [None] * 4


def test_top_k_one_equals_greedy_at_any_temperature():
    logits = logits_rows(8)
    result = sample(logits, [req(temperature=1.5, top_k=1) for _ in range(8)])
    assert result.token_ids == logits.argmax(-1).tolist()


def test_top_k_and_top_p_restrict_the_support():
    logits = torch.tensor([[5.0, 4.0, 3.0, 0.0] + [-10.0] * (V - 4)])
    gen = torch.Generator().manual_seed(1)
    top2 = {sample(logits, [req(top_k=2)], gen).token_ids[0] for _ in range(200)}
    assert top2 == {0, 1}
    # p(0) ~ 0.665, p(1) ~ 0.245: nucleus 0.8 keeps exactly tokens 0 and 1
    nucleus = {sample(logits, [req(top_p=0.8)], gen).token_ids[0] for _ in range(200)}
    assert nucleus == {0, 1}
    min_p = {sample(logits, [req(min_p=0.5)], gen).token_ids[0] for _ in range(200)}
    assert min_p == {0}


def test_temperature_sampling_follows_the_distribution():
    logits = torch.tensor([[math.log(0.7), math.log(0.3)] + [-1e9] * (V - 2)])
    gen = torch.Generator().manual_seed(3)
    draws = [sample(logits, [req()], gen).token_ids[0] for _ in range(2000)]
    assert abs(draws.count(0) / 2000 - 0.7) < 0.05


def test_seeded_row_ignores_its_batch_neighbours():
    target = logits_rows(1, seed=5)
    params = dict(temperature=0.9, top_p=0.95, seed=1234)
    alone = [sample(target, [req(output=[0] * n, **params)]).token_ids[0] for n in range(20)]
    for batch_size, pos in [(3, 0), (7, 4)]:
        batch = logits_rows(batch_size, seed=9)
        batch[pos] = target[0]
        got = []
        for n in range(20):
            reqs = [req(temperature=1.0) for _ in range(batch_size)]
            reqs[pos] = req(output=[0] * n, **params)
            got.append(sample(batch, reqs).token_ids[pos])
        assert got == alone
    assert len(set(alone)) > 1  # it is really sampling


def test_repetition_penalty_demotes_seen_tokens():
    logits = torch.zeros(1, V)
    logits[0, 3], logits[0, 4] = 2.0, 1.5
    assert sample(logits, [req(temperature=0, prompt=[3])]).token_ids == [3]
    assert sample(logits, [req(temperature=0, prompt=[3], repetition_penalty=2.0)]).token_ids == [4]


def test_presence_and_frequency_penalties_use_output_counts():
    logits = torch.zeros(1, V)
    logits[0, 3], logits[0, 4] = 1.0, 0.5
    assert sample(logits, [req(temperature=0, output=[3], presence_penalty=1.0)]).token_ids == [4]
    assert sample(logits, [req(temperature=0, output=[3], frequency_penalty=0.4)]).token_ids == [3]
    assert sample(logits, [req(temperature=0, output=[3, 3], frequency_penalty=0.4)]).token_ids == [4]


def test_blocked_tokens_are_never_picked():
    logits = logits_rows(1)
    best = int(logits.argmax())
    assert sample(logits, [req(temperature=0, blocked=[best])]).token_ids[0] != best


def test_logprobs_report_the_model_distribution():
    logits = logits_rows(2)
    result = sample(logits, [req(temperature=0, logprobs=3), req(temperature=0)])
    lp = result.logprobs[0]
    expected = logits[0].log_softmax(-1)
    assert lp.token_id == result.token_ids[0]
    assert lp.logprob == pytest.approx(float(expected.max()), abs=1e-5)
    assert lp.top_token_ids == expected.topk(3).indices.tolist()
    assert lp.top_logprobs == pytest.approx(expected.topk(3).values.tolist(), abs=1e-5)
    assert result.logprobs[1] is None
    zero = sample(logits, [req(temperature=0, logprobs=0)]).logprobs[0]
    assert zero.top_token_ids == [] and zero.logprob == pytest.approx(lp.logprob)


def test_plain_greedy_rows_are_argmax_also_when_other_knobs_share_the_batch():
    logits = logits_rows(4, seed=5)
    ids = logits.argmax(-1).tolist()
    blocked = ids[1]
    result = sample(
        logits,
        [
            req(temperature=0),
            req(temperature=0, blocked=(blocked,)),
            req(temperature=0, logprobs=2),
            req(temperature=0, repetition_penalty=1.3),
        ],
    )
    assert result.token_ids[0] == ids[0] and result.token_ids[1] != blocked
    assert result.logprobs[0] is None and result.logprobs[2].top_token_ids[0] == ids[2]


def test_a_mixed_batch_reads_the_device_once():
    """Penalties, blocked tokens, min_p, seeds, greedy and random rows together: the token ids are the
    one value read back (no unique/bincount/any() per row, which on a GPU each wait for the device)."""
    requests = [
        req(output=(3, 3, 4), repetition_penalty=1.3, temperature=0),
        req(output=(5,), presence_penalty=0.5, frequency_penalty=0.2, temperature=0.8, seed=7),
        req(blocked=(2, 9), temperature=1.0, min_p=0.05),
        req(temperature=0.7, top_k=5, top_p=0.9),
    ]
    with watch_host_syncs() as syncs:
        result = sample(logits_rows(4), requests, torch.Generator().manual_seed(0))
    assert syncs == ["Tensor.tolist"] and len(result.token_ids) == 4
