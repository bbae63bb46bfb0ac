"""num_leading_held: only a run of held blocks from the chain's start counts."""

import pytest

from ferry.balancing.chains import num_leading_held

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    ("held", "chain", "expected"),
    [
        (None, [b"a", b"b"], 0),
        (set(), [b"a"], 0),
        ({b"a", b"b", b"c"}, [b"a", b"b", b"c"], 3),
        ({b"a", b"c"}, [b"a", b"b", b"c"], 1),  # c without b is of no use
        ({b"b", b"c"}, [b"a", b"b", b"c"], 0),
        ({b"a"}, [], 0),
    ],
)
def test_counts_the_run_from_the_start(held, chain, expected):
    assert num_leading_held(held, chain) == expected
