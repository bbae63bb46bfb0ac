"""Which rank of a worker group takes a new sequence (ferry.parallel.dealing, pure)."""

from __future__ import annotations

import pytest

from ferry.parallel.dealing import RankState, ranks_by_preference

pytestmark = pytest.mark.unit


def test_the_rank_with_the_least_batch_fill_and_kv_usage_comes_first():
    ranks = [RankState(4, 8, 10, 100), RankState(2, 8, 10, 100), RankState(2, 8, 60, 100)]
    assert ranks_by_preference(ranks, num_blocks=2) == [1, 0, 2]  # 0.495, 0.745, 0.995


def test_ties_go_to_the_lower_rank():
    assert ranks_by_preference([RankState(0, 4, 0, 10)] * 3, num_blocks=1) == [0, 1, 2]


def test_a_rank_the_sequence_does_not_fit_comes_last_however_idle():
    full_kv = RankState(0, 8, 95, 100)  # idle, but 10 blocks do not fit
    capped = RankState(8, 8, 0, 100)  # at its batch cap
    busy = RankState(6, 8, 70, 100)
    assert ranks_by_preference([full_kv, capped, busy], num_blocks=10)[0] == 2
    assert not full_kv.fits(10) and not capped.fits(1) and busy.fits(10)
