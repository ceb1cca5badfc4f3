"""What the supervisor's loop tells the user about a run that went wrong: its errors, built
from the run's ranks, and its straggler notices.

The loop (``_supervisor.py``) decides *when*: a failure, the ``timeout``, a rendezvous that
never completed, a rank still running long after the first finished. This module builds
*what*: the launch error (``_errors.py``) with its text (``_diagnosis.py``, pure), the
outcomes, every rank's log and the run's reports. The builders only read the
:class:`~_pump.Run` they are given and change nothing, so a live session
(``_live/_session.py``) builds its own errors from the same pieces. Two things here need the
loop's reading: taking the ranks' stacks (:func:`stacks`, SIGUSR1 and a short read) and the
straggler notices, which take a stack for each straggler (:func:`straggler_notices`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import TypeVar

from . import _diagnosis, _watchdogs
from ._errors import (
    LaunchError,
    LaunchTimeoutError,
    RankOutcome,
    RendezvousTimeoutError,
    WorkerFailedError,
)
from ._pump import Run
from ._rank_handle import Rank

_Error = TypeVar("_Error", bound=LaunchError)

#: A rank's stacks, parsed, by its index among the run's ranks.
Stacks = dict[int, list[_diagnosis.Frame]]


def logs(run: Run) -> list[str]:
    """The run's log text, one per rank, for an error (what the cell showed of each)."""
    return [run.router.log_text(rank.index) for rank in run.ranks]


def with_reports(error: _Error, run: Run) -> _Error:
    """``error`` carrying the run's reports (what ``nb_dist.report`` sent before it ended),
    so a failed run's numbers are not lost with it."""
    error.reports = run.reports
    return error


def stacks(ranks: list[Rank], read: Callable[[float], None]) -> Stacks:
    """Ask ``ranks`` that are alive for their Python stacks (SIGUSR1 → faulthandler), read
    the dumps with ``read`` (the loop's, so other output keeps flowing) until they stop
    growing (0.5 s at most), and parse them."""
    asked = [rank for rank in ranks if rank.ask_for_stack()]
    deadline = time.monotonic() + 0.5
    quiet_since: float | None = None
    while asked and time.monotonic() < deadline:
        before = sum(len(rank.stack) for rank in asked)
        read(0.02)
        if all(rank.stack for rank in asked) and sum(len(rank.stack) for rank in asked) == before:
            quiet_since = quiet_since or time.monotonic()
            if time.monotonic() - quiet_since > 0.05:
                break
        else:
            quiet_since = None
    return {rank.index: rank.read_stack() for rank in asked}


def stuck_views(
    run: Run,
    live: list[Rank],
    frames: Stacks,
    counter_file: Callable[[Rank], str | None],
) -> list[_diagnosis.StuckRank]:
    """Every rank of ``run`` for a timeout report: where the ``live`` ones were (``frames``),
    and their collectives (read from each rank's ``counter_file``)."""
    return [
        rank.stuck_view(rank in live, frames.get(rank.index), counter_file(rank))
        for rank in run.ranks
    ]


def timeout_error(
    run: Run,
    timeout: float,
    live: list[Rank],
    frames: Stacks,
    counter_file: Callable[[Rank], str | None],
) -> LaunchTimeoutError:
    """The launch's ``timeout`` passed: where each rank was (``live`` ones' ``frames``) and
    what it was waiting for, with the outcomes, logs and reports."""
    views = stuck_views(run, live, frames, counter_file)
    text, stacks_text = _diagnosis.timeout_report(timeout, views)
    outcomes = [rank.outcome for rank in run.ranks]
    return with_reports(LaunchTimeoutError(text, timeout, stacks_text, outcomes, logs(run)), run)


def rendezvous_error(
    run: Run, limit: float, live: list[Rank], frames: Stacks, now: float
) -> RendezvousTimeoutError:
    """The rendezvous did not complete within ``limit`` s: who entered, who joined, and
    where the ``live`` ranks were (``frames``) at ``now``."""
    views = [rank.rendezvous_view(now, rank in live, frames.get(rank.index)) for rank in run.ranks]
    text, stacks_text = _diagnosis.rendezvous_report(limit, len(run.ranks), views)
    outcomes = [rank.outcome for rank in run.ranks]
    error = RendezvousTimeoutError(text, limit, stacks_text, outcomes, logs(run))
    return with_reports(error, run)


def failure_error(
    run: Run, root: RankOutcome, run_logs: list[str], held: Rank | None
) -> WorkerFailedError:
    """A run that ended with a failure: the ``root`` cause's report (its log from
    ``run_logs``, taken when the run ended), a note on the ``held`` rank's post-mortem if one
    waits at its prompt, and the run's closing note (its policy's: a live session says
    whether it survived)."""
    outcomes = [rank.outcome for rank in run.ranks]
    # The root's log by its place among this kernel's ranks (its LOCAL_RANK is its place on
    # its node: on a cluster every node has a LOCAL_RANK 0).
    root_log = run_logs[next(i for i, o in enumerate(outcomes) if o is root)]
    message = _diagnosis.failure_message(root, outcomes, root_log)
    if held is not None:
        message += "\n\n" + _diagnosis.post_mortem_note(held.outcome.rank)
    closing = run.policy.closing_note
    note = closing() if closing is not None else ""
    if note:
        message += "\n\n" + note
    return with_reports(WorkerFailedError(message, root, outcomes, run_logs), run)


def straggler_notices(
    run: Run, limit: float | None, stacks_of: Callable[[list[Rank]], Stacks]
) -> Iterator[str]:
    """The notices due now for ranks still running ``limit`` s after the first finished
    (``None``: never): where each straggler is (its stack, from ``stacks_of``), or that it
    returned and hangs in its teardown. Each rank is noticed once (``run.hang_noticed``); one
    notice is built at a time, so each is shown before the next rank's stack is taken."""
    waited = _watchdogs.straggler_wait(run.first_finish, limit, time.monotonic())
    if waited is None:
        return
    finished = [rank.outcome.rank for rank in run.ranks if rank.outcome.status == "ok"]
    for rank in run.ranks:
        if rank.finished or not rank.alive or rank.index in run.hang_noticed:
            continue
        run.hang_noticed.add(rank.index)
        returned = rank.outcome.returned_at
        if returned is not None:
            yield _diagnosis.teardown_notice(rank.outcome.rank, time.monotonic() - returned)
            continue
        frames = stacks_of([rank]).get(rank.index, [])
        yield _diagnosis.straggler_notice(
            rank.outcome.rank, waited, finished, frames, run.policy.limit_hint
        )
