"""The prefill-balancer's recent warm-up chains (for re-warming a restarted worker)."""

import pytest

from ferry_services.prefill_balancer.recent_chains import RecentChains

pytestmark = pytest.mark.unit


def test_a_newer_turn_replaces_its_conversations_older_chain():
    chains = RecentChains()
    chains.add("x-1", "ns", [b"s", b"x1"])
    chains.add("y-1", "ns", [b"s", b"y1"])  # same system prompt, another conversation
    chains.add("x-2", "ns", [b"s", b"x1", b"x2"])
    assert chains.of("ns") == [("y-1", [b"s", b"y1"]), ("x-2", [b"s", b"x1", b"x2"])]
    chains.add("z-1", "other", [b"s", b"x1"])  # another model's chain is its own
    assert len(chains) == 3
    assert chains.of("other") == [("z-1", [b"s", b"x1"])]
    chains.add("empty", "ns", [])
    assert len(chains) == 3


def test_only_the_latest_chains_are_kept():
    chains = RecentChains(max_chains=2)
    for i in range(3):
        chains.add(f"r{i}", "ns", [bytes([i])])
    assert [r for r, _ in chains.of("ns")] == ["r1", "r2"]
    with pytest.raises(ValueError, match="max_chains"):
        RecentChains(max_chains=0)
