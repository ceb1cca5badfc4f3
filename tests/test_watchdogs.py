"""The supervisor's graces and watchdogs on made-up clocks (``nb_dist/_kernel/_watchdogs.py``):
what the launch and live-ranks loops decide at each moment, without waiting real seconds."""

from __future__ import annotations

import pytest

from nb_dist._kernel import _watchdogs as w

#: Unit tests and quick launches: all in the fast lane (python -m pytest -m fast).
pytestmark = pytest.mark.fast


def test_a_run_is_late_only_past_its_deadline_plus_the_time_at_a_prompt():
    assert not w.late(None, 0.0, 1e9)  # no deadline: never late
    assert not w.late(10.0, 0.0, 9.99)
    assert w.late(10.0, 0.0, 10.0)
    assert not w.late(10.0, 5.0, 14.9)  # 5 s at a debugger prompt do not count
    assert w.late(10.0, 5.0, 15.0)


def test_the_next_wait_is_a_poll_interval_shorter_near_a_deadline_or_an_exit():
    assert w.next_wait(0.1, False, None, 0.0, 0.0) == 0.1
    assert w.next_wait(0.1, True, None, 0.0, 0.0) == w.EXITING_POLL
    assert w.next_wait(0.1, False, 10.0, 0.0, 9.95) == pytest.approx(0.05)
    assert w.next_wait(0.1, False, 10.0, 0.0, 11.0) == 0.0  # past it: no negative wait
    assert w.next_wait(0.1, False, 10.0, 2.0, 11.0) == 0.1  # the pause moved the deadline


def test_the_straggler_notice_is_due_once_the_limit_passed_after_the_first_finish():
    assert w.straggler_wait(None, 30.0, 100.0) is None  # nobody finished yet
    assert w.straggler_wait(50.0, None, 1e9) is None  # notices off
    assert w.straggler_wait(50.0, 30.0, 79.9) is None
    assert w.straggler_wait(50.0, 30.0, 80.0) == 30.0
    assert w.straggler_wait(50.0, 30.0, 95.5) == 45.5


def test_a_rendezvous_is_overdue_counted_from_the_first_rank_to_enter():
    assert not w.rendezvous_overdue([], 20.0, 1e9)  # nobody entered
    assert not w.rendezvous_overdue([5.0], None, 1e9)  # no limit
    assert not w.rendezvous_overdue([7.0, 5.0], 20.0, 24.9)
    assert w.rendezvous_overdue([7.0, 5.0], 20.0, 25.0)


def test_after_a_failure_live_ranks_wait_then_are_interrupted_then_given_up():
    failed = 0.0  # exact sums: the boundaries themselves are checked
    assert w.after_failure(failed, failed) == "wait"
    assert w.after_failure(failed, failed + w.FAILURE_GRACE - 1e-6) == "wait"
    assert w.after_failure(failed, failed + w.FAILURE_GRACE) == "interrupt"
    end = failed + w.FAILURE_GRACE + w.INTERRUPT_GRACE
    assert w.after_failure(failed, end - 1e-6) == "interrupt"
    assert w.after_failure(failed, end) == "give up"


def test_the_interrupt_goes_at_once_then_again_every_repeat_interval():
    assert w.interrupt_due(False, 0.0, 0.0)
    assert not w.interrupt_due(True, 10.0, 10.0 + w.REPEAT_INTERRUPT / 2)
    assert w.interrupt_due(True, 10.0, 10.0 + w.REPEAT_INTERRUPT)


def test_a_deadlock_is_due_once_it_has_looked_the_same_long_enough():
    assert not w.deadlock_due(None, 100.0)
    assert not w.deadlock_due(100.0, 100.0 + w.DEADLOCK_SETTLE / 2)
    assert w.deadlock_due(100.0, 100.0 + w.DEADLOCK_SETTLE)
