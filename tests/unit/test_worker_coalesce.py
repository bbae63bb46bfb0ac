"""Token events held back per stream (FERRY_STREAM_INTERVAL_MS): what goes at once, what waits, how it merges."""

import pytest

from ferry.protocol import ErrorEvent, OutputBatch, TokenEvent, TokenLogprob
from ferry_services.worker.coalesce import StreamCoalescer, merge

pytestmark = pytest.mark.unit


def ev(request_id: str, index: int, text: str = "", finish: str | None = None, attempt: int = 0, **kw) -> TokenEvent:
    return TokenEvent(request_id, index, [100 + index], text, finish_reason=finish, attempt=attempt, **kw)


def step(*events: TokenEvent, gateway: str = "g") -> dict[str, OutputBatch]:
    return {gateway: OutputBatch("w", tokens=list(events))}


def sent(out: dict[str, OutputBatch]) -> list[tuple]:
    return [(g, e.request_id, e.index, e.token_ids, e.text, e.finish_reason) for g, b in out.items() for e in b.tokens]


def test_first_token_goes_at_once_the_next_ones_wait_for_the_interval():
    c = StreamCoalescer(0.05)
    assert sent(c.add(step(ev("a", 0, "A")), 0.0, "w")) == [("g", "a", 0, [100], "A", None)]
    assert c.add(step(ev("a", 1, "b")), 0.01, "w") == {}
    assert c.add(step(ev("a", 2, "c")), 0.03, "w") == {}
    assert len(c) == 1 and c.next_due() == pytest.approx(0.06)
    # the step at 0.07: the held run (since 0.01) is due, merged with this step's token
    assert sent(c.add(step(ev("a", 3, "d")), 0.07, "w")) == [("g", "a", 1, [101, 102, 103], "bcd", None)]
    assert len(c) == 0 and c.next_due() is None


def test_the_finishing_event_goes_at_once_with_what_was_held():
    c = StreamCoalescer(1.0)
    c.add(step(ev("a", 0)), 0.0, "w")
    c.add(step(ev("a", 1, "x")), 0.1, "w")
    out = c.add(step(ev("a", 2, "y", finish="stop", num_prompt_tokens=7)), 0.2, "w")
    assert sent(out) == [("g", "a", 1, [101, 102], "xy", "stop")]
    assert out["g"].tokens[0].num_prompt_tokens == 7


def test_zero_interval_holds_nothing():
    c = StreamCoalescer(0.0)
    assert sent(c.add(step(ev("a", 4, "x")), 0.0, "w")) == [("g", "a", 4, [104], "x", None)]
    assert len(c) == 0


def test_due_releases_what_waited_and_keeps_the_rest_per_gateway():
    c = StreamCoalescer(0.05)
    c.add({"g1": OutputBatch("w", tokens=[ev("a", 1)]), "g2": OutputBatch("w", tokens=[ev("b", 5)])}, 0.0, "w")
    c.add(step(ev("c", 3), gateway="g1"), 0.03, "w")
    out = c.due(0.06, "w")
    assert sorted(sent(out)) == [("g1", "a", 1, [101], "", None), ("g2", "b", 5, [105], "", None)]
    assert all(b.worker_id == "w" for b in out.values())
    assert sent(c.due(0.08, "w")) == [("g1", "c", 3, [103], "", None)]


def test_take_one_request_or_all_and_errors_pass_through():
    c = StreamCoalescer(1.0)
    c.add(step(ev("a", 1), ev("b", 1)), 0.0, "w")
    assert sent(c.take("a", "w")) == [("g", "a", 1, [101], "", None)]
    assert c.take("a", "w") == {}
    error = ErrorEvent("z", "worker_lost", "gone", True)
    out = c.add({"g": OutputBatch("w", errors=[error])}, 0.1, "w")
    assert out["g"].errors == [error] and out["g"].tokens == []
    assert sent(c.take_all("w")) == [("g", "b", 1, [101], "", None)]
    assert len(c) == 0


def test_attempts_are_separate_streams():
    c = StreamCoalescer(1.0)
    c.add(step(ev("a", 3, attempt=0), ev("a", 3, attempt=1)), 0.0, "w")
    assert len(c) == 2


def test_merge_keeps_logprobs_and_refuses_gaps_and_other_streams():
    lp = TokenLogprob(101, -0.5, [101], [-0.5])
    merged = merge(ev("a", 1, "x", logprobs=[lp]), ev("a", 2, "y", logprobs=[lp]))
    assert merged.logprobs == [lp, lp] and merged.token_ids == [101, 102] and merged.index == 1
    assert merge(ev("a", 1), ev("a", 2)).logprobs is None
    with pytest.raises(ValueError, match=r"second\.index"):
        merge(ev("a", 1), ev("a", 3))
    with pytest.raises(ValueError, match="another stream"):
        merge(ev("a", 1), ev("b", 2))
    with pytest.raises(ValueError, match="interval_s"):
        StreamCoalescer(-1)
