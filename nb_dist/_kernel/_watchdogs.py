"""The supervisor's clocks as pure functions: when a run is late, when a notice is due,
how long the next wait may be, what a live task does after a rank failed.

Every function takes the times it needs (``now`` from the caller's ``time.monotonic()``),
so the graces and watchdogs are unit-tested with made-up clocks (``tests/test_watchdogs.py``)
instead of real seconds on a loaded machine. Runs in the kernel.
"""

from __future__ import annotations

from typing import Literal

#: Live ranks: after a rank fails, how long the others may take to finish the task alone.
FAILURE_GRACE = 0.1
#: Live ranks: after an interrupt, how long a rank may take to stop its task (then it is
#: killed, and the session with it).
INTERRUPT_GRACE = 0.7
#: While waiting for interrupted ranks, the interrupt is sent again this often.
REPEAT_INTERRUPT = 0.05
#: A rank whose pipes closed is exiting: poll for its exit this often, not a whole interval.
EXITING_POLL = 0.002


#: Live ranks: how long a skipped collective must look the same before the cell is ended (a
#: rank's counts are read while it runs; a deadlock does not change, a passing state does).
DEADLOCK_SETTLE = 0.4


def deadlock_due(since: float | None, now: float) -> bool:
    """Whether a skipped collective seen unchanged since ``since`` is due to be reported."""
    return since is not None and now - since >= DEADLOCK_SETTLE


def late(deadline: float | None, paused_for: float, now: float) -> bool:
    """Whether a run's ``deadline`` has passed; time spent at a debugger prompt is not work."""
    return deadline is not None and now >= deadline + paused_for


def next_wait(
    poll_interval: float, exiting: bool, deadline: float | None, paused_for: float, now: float
) -> float:
    """How long the loop may wait for the pipes: a poll interval, shorter when a rank is
    exiting (no event will wake the wait) or the deadline is nearer; never negative."""
    wait = min(poll_interval, EXITING_POLL) if exiting else poll_interval
    if deadline is not None:
        wait = max(0.0, min(wait, deadline + paused_for - now))
    return wait


def straggler_wait(first_finish: float | None, limit: float | None, now: float) -> float | None:
    """Seconds the others have run since the first rank finished, once that reaches
    ``limit`` (the straggler notice is due); else ``None``."""
    if limit is None or first_finish is None:
        return None
    waited = now - first_finish
    return waited if waited >= limit else None


def rendezvous_overdue(entered: list[float], limit: float | None, now: float) -> bool:
    """Whether a rendezvous that began when the first rank entered it is past ``limit``."""
    return limit is not None and bool(entered) and now - min(entered) >= limit


FailurePhase = Literal["wait", "interrupt", "give up"]


def after_failure(failed_at: float, now: float) -> FailurePhase:
    """Live ranks, a rank failed at ``failed_at``: let the others finish alone (``wait``),
    then interrupt them (``interrupt``), then stop the session (``give up``)."""
    since = now - failed_at
    if since < FAILURE_GRACE:
        return "wait"
    if since < FAILURE_GRACE + INTERRUPT_GRACE:
        return "interrupt"
    return "give up"


def interrupt_due(interrupted: bool, last_interrupt: float, now: float) -> bool:
    """Whether to send the interrupt (again): the first one at once, then every
    :data:`REPEAT_INTERRUPT` s (a rank that had not entered its task ignored the last)."""
    return not interrupted or now - last_interrupt >= REPEAT_INTERRUPT
