"""The worker's request ledger: what a pulled message is, what a cancel or a newer attempt does,
and the races the worker relies on it for (an event arriving while an engine addition waits its
turn on the engine thread). Pure: handles are plain objects, the engine is a model of one FIFO
thread."""

from __future__ import annotations

import random
from collections import deque

import pytest

from ferry.protocol import GenerateRequest, SamplingParams
from ferry_services.worker.ledger import Admit, Effects, RequestLedger, engine_id

pytestmark = pytest.mark.unit


def request(request_id: str = "r", attempt: int = 0) -> GenerateRequest:
    return GenerateRequest(request_id, "gw", "m", [1, 2, 3], SamplingParams(), attempt=attempt)


class Msg:
    """A pulled message's handle."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return self.name


def held_in_engine(ledger: RequestLedger, r: GenerateRequest) -> Msg:
    """Pull `r` and add it to the engine (joined, its message still held); returns the message."""
    msg = Msg(f"m-{r.request_id}-{r.attempt}")
    assert ledger.pulled(r, msg).decision is Admit.NEW
    assert ledger.adding(r)
    assert ledger.added(r, joined=True, ack=False) == Effects()
    return msg


def test_a_new_request_is_held_as_that_very_attempt():
    ledger, r, m = RequestLedger(), request(), Msg("m")
    admission = ledger.pulled(r, m)
    assert admission.decision is Admit.NEW and not admission.effects
    assert ledger.is_current(r) and "r" in ledger and len(ledger) == 1
    assert ledger.request("r") is r and ledger.owner("r@0") is r and ledger.owner("r@1") is None
    assert ledger.handles() == [m]


def test_a_redelivery_of_the_held_attempt_changes_nothing():
    ledger, r = RequestLedger(), request()
    ledger.pulled(r, Msg("first"))
    copy = request()  # the same attempt, decoded again from a redelivered message
    admission = ledger.pulled(copy, Msg("again"))
    assert admission.decision is Admit.REDELIVERY and not admission.effects
    assert ledger.is_current(r) and not ledger.is_current(copy)
    assert [repr(h) for h in ledger.handles()] == ["first"]


def test_an_older_attempt_is_stale_acked_and_dropped():
    ledger, newer, stale_msg = RequestLedger(), request(attempt=2), Msg("stale")
    held_in_engine(ledger, newer)
    admission = ledger.pulled(request(attempt=1), stale_msg)
    assert admission.decision is Admit.STALE and admission.effects == Effects(ack=[stale_msg])
    assert ledger.is_current(newer)


def test_a_newer_attempt_replaces_the_copy_here_aborting_it_in_the_engine():
    ledger, old = RequestLedger(), request(attempt=0)
    old_msg = held_in_engine(ledger, old)
    new = request(attempt=1)
    admission = ledger.pulled(new, Msg("new"))
    assert admission.decision is Admit.NEW
    assert admission.effects == Effects(abort=["r@0"], ack=[old_msg])
    assert ledger.is_current(new) and not ledger.is_current(old)
    assert ledger.owner("r@0") is None and ledger.owner("r@1") is new


def test_a_newer_attempt_replacing_one_still_fetching_kv_aborts_nothing():
    ledger, old, old_msg = RequestLedger(), request(attempt=0), Msg("old")
    ledger.pulled(old, old_msg)  # not added yet: its KV is on the way
    admission = ledger.pulled(request(attempt=1), Msg("new"))
    assert admission.effects == Effects(ack=[old_msg])
    assert not ledger.adding(old)  # the old attempt's admission, when its KV arrives, adds nothing


def test_a_cancel_aborts_acks_and_is_remembered_for_later_messages():
    ledger, r = RequestLedger(), request()
    msg = held_in_engine(ledger, r)
    assert ledger.cancel(["r", "unknown"]) == Effects(abort=["r@0"], ack=[msg])
    assert "r" not in ledger and "r" in ledger.cancelled and "unknown" in ledger.cancelled
    late = Msg("late")  # e.g. a hand-off still queued for it
    admission = ledger.pulled(request(attempt=3), late)
    assert admission.decision is Admit.CANCELLED and admission.effects == Effects(ack=[late])
    assert len(ledger) == 0


def test_cancel_below_attempt_spares_the_current_attempt_and_is_not_remembered():
    ledger, r = RequestLedger(), request(attempt=2)
    msg = held_in_engine(ledger, r)
    assert not ledger.cancel(["r"], below_attempt=2)  # only older attempts: this one stays
    assert ledger.is_current(r)
    assert ledger.cancel(["r"], below_attempt=3) == Effects(abort=["r@2"], ack=[msg])
    assert "r" not in ledger and "r" not in ledger.cancelled
    assert ledger.pulled(request(attempt=3), Msg("next")).decision is Admit.NEW  # the current attempt arrives


def test_cancel_below_attempt_of_a_request_not_held_is_not_remembered():
    ledger = RequestLedger()
    assert not ledger.cancel(["r"], below_attempt=1)
    assert ledger.pulled(request(attempt=1), Msg("m")).decision is Admit.NEW


def test_a_cancel_while_the_addition_waits_for_the_engine_thread_queues_its_abort_behind_it():
    """The race `abort_if_gone` guarded: the addition is queued, then the cancel comes. The abort
    must be queued too (behind the addition, so it finds the sequence); the addition's completion
    then has nothing left to do."""
    ledger, r, msg = RequestLedger(), request(), Msg("m")
    ledger.pulled(r, msg)
    assert ledger.adding(r)
    assert ledger.cancel(["r"]) == Effects(abort=["r@0"], ack=[msg])
    assert ledger.added(r, joined=True, ack=True) == Effects()  # not acked twice, not held
    assert "r" not in ledger


def test_a_newer_attempt_while_the_older_addition_waits_aborts_the_older_only():
    ledger, old, new, new_msg = RequestLedger(), request(attempt=0), request(attempt=1), Msg("new")
    ledger.pulled(old, Msg("old"))
    assert ledger.adding(old)
    assert ledger.pulled(new, new_msg).effects.abort == ["r@0"]
    assert ledger.added(old, joined=True, ack=True) == Effects()
    assert ledger.adding(new) and ledger.added(new, joined=True, ack=True) == Effects(ack=[new_msg])


def test_a_cancel_before_the_addition_means_no_addition_and_no_abort():
    ledger, r, msg = RequestLedger(), request(), Msg("m")
    ledger.pulled(r, msg)  # its KV is being fetched
    assert ledger.cancel(["r"]) == Effects(ack=[msg])
    assert not ledger.adding(r)


def test_no_room_keeps_the_message_held_until_a_retry_joins():
    ledger, r, msg = RequestLedger(), request(), Msg("m")
    ledger.pulled(r, msg)
    assert ledger.adding(r)
    assert ledger.added(r, joined=False, ack=True) == Effects()  # refused: nothing settled, still held
    assert len(ledger) == 1 and ledger.request("r") is r
    assert ledger.adding(r)  # the worker tries the join again after an engine step
    assert ledger.added(r, joined=True, ack=True) == Effects(ack=[msg])


def test_a_cancel_while_waiting_for_room_settles_the_message_and_stops_the_retry():
    ledger, r, msg = RequestLedger(), request(), Msg("m")
    ledger.pulled(r, msg)
    assert ledger.adding(r) and ledger.added(r, joined=False, ack=False) == Effects()
    assert ledger.cancel(["r"]) == Effects(ack=[msg])  # not in the engine: no abort to queue
    assert not ledger.adding(r) and len(ledger) == 0


def test_decode_acks_on_joining_then_finishing_settles_nothing_more():
    ledger, r, msg = RequestLedger(), request(), Msg("m")
    ledger.pulled(r, msg)
    ledger.adding(r)
    assert ledger.added(r, joined=True, ack=True) == Effects(ack=[msg])
    assert ledger.handles() == []
    assert ledger.finished("r@0") == Effects() and len(ledger) == 0


def test_an_output_of_a_replaced_attempt_finishing_does_not_touch_the_current_one():
    ledger, old, new = RequestLedger(), request(attempt=0), request(attempt=1)
    held_in_engine(ledger, old)
    ledger.pulled(new, Msg("new"))
    assert ledger.finished("r@0") == Effects()
    assert ledger.is_current(new)


def test_prefill_hand_off_acks_once_done_and_a_cancel_meanwhile_settles_it_instead():
    ledger, r = RequestLedger(), request()
    msg = held_in_engine(ledger, r)
    ledger.left_engine(r)  # KV taken out for the hand-off
    assert ledger.done(r) == Effects(ack=[msg]) and len(ledger) == 0
    other = request("o")
    other_msg = held_in_engine(ledger, other)
    ledger.left_engine(other)
    assert ledger.cancel(["o"]) == Effects(ack=[other_msg])  # nothing to abort: not in the engine
    assert ledger.done(other) == Effects()  # the hand-off finishing later settles nothing twice


def test_a_draining_worker_gives_new_messages_back_and_still_drops_dead_ones():
    ledger, held = RequestLedger(), request("held")
    ledger.pulled(held, Msg("held"))
    ledger.cancel(["gone"])
    ledger.draining = True
    fresh = Msg("fresh")
    admission = ledger.pulled(request("new"), fresh)
    assert admission.decision is Admit.GIVEN_BACK and admission.effects == Effects(nak=[(fresh, None)])
    assert "new" not in ledger
    assert ledger.pulled(request("gone"), Msg("g")).decision is Admit.CANCELLED
    assert ledger.pulled(request("held"), Msg("again")).decision is Admit.REDELIVERY


def test_release_all_hands_everything_over_for_shutdown():
    ledger, running, fetching = RequestLedger(), request("run"), request("fetch")
    held_in_engine(ledger, running)
    ledger.pulled(fetching, Msg("f"))
    released = {h.request.request_id: h for h in ledger.release_all()}
    assert len(ledger) == 0 and not ledger.is_current(running)
    assert released["run"].in_engine and not released["fetch"].in_engine
    assert repr(released["fetch"].handle) == "f"


def test_engine_ids_name_one_attempt_even_with_odd_request_ids():
    ledger, r = RequestLedger(), request("a@1")
    ledger.pulled(r, Msg("m"))
    assert engine_id(r) == "a@1@0" and ledger.owner("a@1@0") is r
    assert ledger.owner("a@1") is None and ledger.owner("a") is None and ledger.owner("") is None


class EngineModel:
    """The engine thread as a FIFO queue of additions and aborts, and the sequences it holds."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.queue: deque = deque()
        self.sequences: set[str] = set()
        self.completed: list[tuple[GenerateRequest, bool]] = []
        """Additions that ran (joined or refused) whose completion the worker has not seen yet."""

    def run_one(self) -> None:
        op, arg = self.queue.popleft()
        if op == "abort":
            self.sequences.discard(arg)
            return
        joined = self.rng.random() < 0.8  # else: no room
        if joined:
            assert engine_id(arg) not in self.sequences, f"{engine_id(arg)} added twice"
            self.sequences.add(engine_id(arg))
        self.completed.append((arg, joined))


@pytest.mark.parametrize("seed", range(300))
def test_random_interleavings_leave_in_the_engine_exactly_what_is_held(seed):
    """Pulls, cancels (every attempt / below one), additions queued, run and completed (joined or
    refused for room), finished sequences, in random order, against a model of the engine thread.
    Throughout: no message settled twice, no sequence added twice. At the end, once the queue has
    run: the engine holds exactly the held attempts the ledger says are in it."""
    rng = random.Random(seed)
    ledger, engine = RequestLedger(), EngineModel(rng)
    settled: set[Msg] = set()  # by identity; kept alive, so no id is reused
    admitted: list[GenerateRequest] = []  # request objects whose (single) addition was started

    def apply(effects: Effects) -> None:
        engine.queue.extend(("abort", sequence_id) for sequence_id in effects.abort)
        for handle in [*effects.ack, *(h for h, _ in effects.nak)]:
            assert handle not in settled, f"{handle} settled twice"
            settled.add(handle)

    def complete(r: GenerateRequest, joined: bool) -> None:
        apply(ledger.added(r, joined=joined, ack=rng.random() < 0.5))
        if not joined:  # no room: the worker keeps the message and may try the same request's join again
            admitted[:] = [a for a in admitted if a is not r]

    for step in range(80):
        action = rng.choice(["pull", "pull", "add", "run", "run", "complete", "cancel", "finish"])
        request_id = rng.choice("ab")
        if action == "pull":
            apply(ledger.pulled(request(request_id, rng.randrange(4)), Msg(f"{request_id}{step}")).effects)
        elif action == "add":
            r = ledger.request(request_id)
            if r is not None and not any(r is a for a in admitted):
                admitted.append(r)
                assert ledger.adding(r)
                engine.queue.append(("add", r))
        elif action == "run" and engine.queue:
            engine.run_one()
        elif action == "complete" and engine.completed:
            complete(*engine.completed.pop(rng.randrange(len(engine.completed))))
        elif action == "cancel":
            apply(ledger.cancel([request_id], rng.choice([None, 1, 2, 3])))
        elif action == "finish" and engine.sequences:
            sequence_id = rng.choice(sorted(engine.sequences))
            engine.sequences.discard(sequence_id)
            apply(ledger.finished(sequence_id))
    while engine.queue:
        engine.run_one()
    for r, joined in engine.completed:
        complete(r, joined)
    in_engine = {engine_id(h.request) for h in ledger.release_all() if h.in_engine}
    assert engine.sequences == in_engine
