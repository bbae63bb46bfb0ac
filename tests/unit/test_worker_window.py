"""AdmissionWindow (services/worker/window.py): the next step waits for prompts on their way (pulled and
not yet queued on the engine thread, or queued in JetStream behind the last pull), never for a lone
request, never past its budget of tokens or its window."""

import pytest

from ferry_services.worker.window import AdmissionWindow

pytestmark = pytest.mark.unit

BUDGET = 2048


def test_a_lone_request_never_waits():
    window = AdmissionWindow(0.02)
    window.pulled(["a"], num_pending=0)
    window.queued("a")
    assert not window.should_hold(0.0, can_pull=True, num_queued_tokens=100, budget_tokens=BUDGET)


def test_waits_while_a_pulled_prompt_is_not_on_the_engine_thread_yet():
    window = AdmissionWindow(0.02)
    window.pulled(["a", "b"], num_pending=0)
    window.queued("a")
    assert window.should_hold(0.0, can_pull=True, num_queued_tokens=100, budget_tokens=BUDGET)
    window.queued("b")
    assert not window.should_hold(0.001, can_pull=True, num_queued_tokens=100, budget_tokens=BUDGET)


@pytest.mark.parametrize("num_pending,num_routing", [(5, 0), (0, 5)])
def test_waits_for_what_is_behind_the_last_pull_while_there_is_room_to_pull_it(num_pending, num_routing):
    """Behind the last pull: messages JetStream holds for this worker (num_pending), or, for a burst's first
    message, submits the balancer still routes (its stamp, num_routing; JetStream holds none of them yet)."""
    window = AdmissionWindow(0.02)
    window.pulled(["a"], num_pending=num_pending, num_routing=num_routing)
    window.queued("a")
    assert window.should_hold(0.0, can_pull=True, num_queued_tokens=100, budget_tokens=BUDGET)
    assert not window.should_hold(0.0, can_pull=False, num_queued_tokens=100, budget_tokens=BUDGET)
    window.pulled([], num_pending=0)  # the next fetch found nothing more
    assert not window.should_hold(0.0, can_pull=True, num_queued_tokens=100, budget_tokens=BUDGET)


def test_a_full_step_or_the_end_of_the_window_goes_at_once():
    window = AdmissionWindow(0.02)
    window.pulled(["a"], num_pending=30)
    assert not window.should_hold(0.0, can_pull=True, num_queued_tokens=BUDGET, budget_tokens=BUDGET)
    assert not window.should_hold(0.02, can_pull=True, num_queued_tokens=100, budget_tokens=BUDGET)
    assert window.should_hold(0.019, can_pull=True, num_queued_tokens=100, budget_tokens=BUDGET)


def test_off_at_zero_and_refuses_a_negative_window():
    window = AdmissionWindow(0.0)
    window.pulled(["a"], num_pending=30)
    assert not window.should_hold(0.0, can_pull=True, num_queued_tokens=0, budget_tokens=BUDGET)
    with pytest.raises(ValueError, match="window_s"):
        AdmissionWindow(-1.0)


def test_an_idle_engine_holds_its_first_step_past_the_window_and_a_full_budget_up_to_burst_s():
    """A burst's first step waits for the whole burst (shortest-first then picks among all of it), at
    most burst_s; a step on a busy engine keeps the short window and goes once its budget is full."""
    window = AdmissionWindow(0.02, burst_s=0.1)
    window.pulled(["a"], num_pending=0, num_routing=30)
    window.queued("a")
    assert window.should_hold(0.05, can_pull=True, num_queued_tokens=BUDGET, budget_tokens=BUDGET, is_idle=True)
    assert not window.should_hold(0.1, can_pull=True, num_queued_tokens=100, budget_tokens=BUDGET, is_idle=True)
    assert not window.should_hold(0.05, can_pull=True, num_queued_tokens=100, budget_tokens=BUDGET)
    assert not window.should_hold(0.0, can_pull=True, num_queued_tokens=BUDGET, budget_tokens=BUDGET)
    assert (window.limit_s(is_idle=True), window.limit_s(is_idle=False)) == (0.1, 0.02)


def test_a_lone_request_on_an_idle_engine_never_waits():
    window = AdmissionWindow(0.02, burst_s=0.1)
    window.pulled(["a"], num_pending=0, num_routing=0)
    window.queued("a")
    assert not window.should_hold(0.0, can_pull=True, num_queued_tokens=100, budget_tokens=BUDGET, is_idle=True)
    with pytest.raises(ValueError, match="burst_s"):
        AdmissionWindow(0.02, burst_s=-1.0)


def test_an_idle_engine_holds_while_a_burst_keeps_arriving_even_with_nothing_known_behind():
    """The balancer's queue runs dry mid-burst (the gateway passes it on in spurts): after a request
    pulled during the hold, an idle engine's first step waits until the burst has been quiet for the
    window; a busy engine's step does not (it has its own full budget to run)."""
    window = AdmissionWindow(0.02, burst_s=0.15)
    window.pulled(["a"], num_pending=0, num_routing=0)
    window.queued("a")
    assert window.should_hold(
        0.03, can_pull=True, num_queued_tokens=BUDGET, budget_tokens=BUDGET, is_idle=True, quiet_s=0.01
    )
    assert not window.should_hold(
        0.03, can_pull=True, num_queued_tokens=100, budget_tokens=BUDGET, is_idle=True, quiet_s=0.02
    )
    assert not window.should_hold(0.01, can_pull=True, num_queued_tokens=100, budget_tokens=BUDGET, quiet_s=0.01)
    assert not window.should_hold(
        0.15, can_pull=True, num_queued_tokens=100, budget_tokens=BUDGET, is_idle=True, quiet_s=0.0
    )
    arrived = window.num_arrived
    window.pulled(["b", "c"], num_pending=0)
    assert window.num_arrived == arrived + 2
