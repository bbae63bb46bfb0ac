"""EPLB: the sliding window, replication of hot experts, packing onto ranks, the hierarchical placement."""

from __future__ import annotations

import random

import pytest

from ferry.parallel.eplb import ExpertLoadWindow, balanced_packing, hierarchical_placement, replicate
from ferry.parallel.placement import ExpertPlacement, imbalance

pytestmark = pytest.mark.unit


def test_window_keeps_only_the_last_steps():
    window = ExpertLoadWindow(3, window_steps=2)
    for counts in ([5, 0, 0], [1, 2, 0], [0, 0, 7]):
        window.record(counts)
    assert window.loads() == [1, 2, 7]
    with pytest.raises(ValueError, match="counts: 2 entries for 3 experts"):
        window.record([1, 2])


def test_spare_slots_go_to_the_hottest_expert_per_copy():
    assert replicate([90, 10, 30, 30], 7) == [4, 1, 1, 1]
    assert replicate([40, 10, 30, 30], 6) == [2, 1, 2, 1]


def test_packing_fills_every_bin_equally_and_evens_the_load():
    bins = balanced_packing([9, 1, 8, 2, 5, 5], num_bins=3, per_bin=2)
    assert sorted(len(b) for b in bins) == [2, 2, 2]
    assert sorted(sum([9, 1, 8, 2, 5, 5][i] for i in b) for b in bins) == [10, 10, 10]


def test_uniform_load_stays_balanced_and_every_expert_is_held():
    placement = hierarchical_placement([100] * 16, ep_size=4, slots_per_rank=4, num_groups=4, num_nodes=2)
    assert imbalance(placement.rank_loads([100] * 16)) == 1.0
    assert sorted(e for rank in placement.slots for e in rank) == list(range(16))


def test_skewed_load_is_evened_out_by_copies():
    rng = random.Random(0)
    loads = [int(1000 / (rank + 1) ** 1.1) for rank in range(32)]
    rng.shuffle(loads)
    before = imbalance(ExpertPlacement.contiguous(32, 8).rank_loads(loads))
    placement = hierarchical_placement(loads, ep_size=8, slots_per_rank=5, num_groups=4, num_nodes=1)
    after = imbalance(placement.rank_loads(loads))
    assert before > 1.5 and after < 1.05
    hottest = max(range(32), key=loads.__getitem__)
    assert len(placement.replicas()[hottest]) > 1


def test_whole_groups_bound_what_nodes_can_even_out():
    # group 0 carries 160 of 280: a node holds two whole groups (200 vs 80); inside a node ranks even out
    loads = [40] * 4 + [10] * 12
    placement = hierarchical_placement(loads, ep_size=4, slots_per_rank=5, num_groups=4, num_nodes=2)
    assert placement.rank_loads(loads) == pytest.approx([100, 100, 40, 40])


def test_expert_groups_stay_whole_on_one_node():
    loads = [random.Random(e).randint(1, 100) for e in range(16)]
    placement = hierarchical_placement(loads, ep_size=4, slots_per_rank=5, num_groups=4, num_nodes=2)
    node_experts = [set(placement.slots[0] + placement.slots[1]), set(placement.slots[2] + placement.slots[3])]
    for group in range(4):
        members = set(range(group * 4, group * 4 + 4))
        assert sum(members <= node for node in node_experts) == 1


@pytest.mark.parametrize(
    ("kwargs", "problem"),
    [
        (dict(ep_size=4, slots_per_rank=4, num_groups=3), "num_groups: 3 does not divide"),
        (dict(ep_size=4, slots_per_rank=4, num_groups=4, num_nodes=3), "num_nodes: 3 must divide"),
        (dict(ep_size=4, slots_per_rank=3), "slots_per_rank: 3 x 4 ranks per node cannot hold"),
    ],
)
def test_impossible_shapes_are_refused(kwargs, problem):
    with pytest.raises(ValueError, match=problem):
        hierarchical_placement([1] * 16, **kwargs)


def test_placement_refuses_an_expert_held_nowhere():
    with pytest.raises(ValueError, match=r"experts \[3\] are held by no rank"):
        ExpertPlacement(4, ((0, 1), (2, 2)))
