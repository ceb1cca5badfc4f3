"""The kernel side of one launch attempt: start the ranks, watch them, stop them.

Everything here runs in the thread that called the launcher (the cell's thread), in one
``select`` loop: rank output is written by that thread, so it lands in the launching cell;
an interrupt arrives there as ``KeyboardInterrupt`` and tears the ranks down; and every
rank is reaped and every pipe drained before control returns to the cell.

Where the ranks run is the supervisor's one injected part, its :class:`RankHost`: this
machine (``_local.LocalHost``) or a cluster's node agents
(``_cluster/_remote_attempt.ClusterHost``); the loop, the output, the diagnosis and the
results are the same for both. How a run treats a failure is the other: its
:class:`~_pump.Policy` (``policy=``, a launch's by default).

A launch calls :meth:`Supervisor.run`. Live ranks (``_live/_session.py``) hold a supervisor
and drive its loop task by task through a small public surface (the members the session's
``TaskLoop`` names); the rest stays private. This module is the loop itself (start, read,
poll, watch); how it ends its ranks is ``_teardown.py``, and the errors and notices it raises
and shows are built by ``_run_errors.py``. How a rank is started and reaped is in
``_processes.py``, what it says on its control pipe in ``_protocol.py``, and what a stuck or
failed launch means in ``_diagnosis.py``. A rank's status changes in one place,
:meth:`Supervisor.set_status`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any, Protocol

from .._shared import _protocol
from .._shared._protocol import COLLECTIVES_ENV
from .._shared._reporting import Reports
from .._starter._parts import DRAIN_AFTER_EXIT
from . import _diagnosis, _prompts, _run_errors, _teardown, _watchdogs
from ._attempt_setup import Place
from ._errors import LaunchTimeoutError, RankOutcome, RankStatus
from ._observer import Observer
from ._output import OutputRouter
from ._plan import LaunchPlan
from ._pump import LAUNCH, Policy, Pump, Run, poll_exit
from ._rank_handle import FINAL, Rank

# A partial line (no newline yet) is shown after this long anyway.
PARTIAL_LINE_AFTER = 1.0


@dataclass
class RunResult:
    """A run that ended well: each rank's value, in rank order, with what the run
    collected (the reports, the outcomes, each rank's duration)."""

    values: list[Any]
    reports: Reports
    outcomes: list[RankOutcome]
    durations: list[float | None]


class RankHost(Protocol):
    """Where a supervisor's ranks run: what starting them takes, and ending what was started
    for them (their processes and pipes are the supervisor's ``Rank`` handles either way)."""

    def start(
        self, plan: LaunchPlan, envs: list[dict[str, str]], ranks: list[Rank]
    ) -> Connection | None:
        """Start ``ranks`` (each ``Rank`` gets its process and pipes; the rank at index ``i``
        with ``envs[i]``), or raise with none left running; the lifeline whose closing ends
        them, if held here."""
        ...

    def close(self) -> None:
        """The run is over and the supervisor's pipe ends are closed: end what was started
        for it. With a rank held for a post-mortem, called when that ends instead."""
        ...

    def endpoints(self) -> list[tuple[str, int]] | None:
        """Every rank's TCP socket addresses, read where the ranks run (``None``: they run
        on this machine, read them here)."""
        ...


class Supervisor:
    """Runs one attempt: ``run()`` returns per-rank values or raises a launch error.

    An owner that drives it run by run (a live session) begins each run with ``begin_run``,
    which returns the :class:`~_pump.Run` the owner then reads (its ranks, router, reports),
    and drives it with the loop's operations; the session names the ones it uses in its
    ``TaskLoop`` protocol (``_live/_session.py``). Ending the ranks is ``_teardown.py``'s,
    building the run's errors ``_run_errors.py``'s; the loop calls them.
    """

    def __init__(
        self,
        plan: LaunchPlan,
        rank_envs: list[dict[str, str]],
        places: list[Place],
        router: OutputRouter,
        observer: Observer | None,
        host: RankHost,
        *,
        policy: Policy = LAUNCH,
    ) -> None:
        #: What this run was planned as (``_plan.LaunchPlan``): ranks, timeouts, debugging.
        self.plan = plan
        self.rank_envs = rank_envs
        #: Where the ranks run (this machine unless a cluster's host is given).
        self.host = host
        #: One handle per rank, its local rank from the place its transport decided.
        self.ranks = [
            Rank(i, r, place.local_rank)
            for i, (r, place) in enumerate(zip(plan.ranks, places, strict=True))
        ]
        #: The run now going on: its ranks, output, reports and watchdog marks (``_pump.py``),
        #: under ``policy``. A launch has one; a live session (``_live/_session.py``), which
        #: holds this loop, begins a fresh one for each task (:meth:`begin_run`).
        self.current = Run(self.ranks, router, observer, policy=policy)
        self._pump = Pump()
        self._lifeline: Connection | None = None  # its EOF tells the ranks the kernel died
        #: The failed rank kept for a post-mortem (``debug="postmortem"``), if any.
        self.held: Rank | None = None
        self._post_mortem_given = False  # the held rank went to the error's PostMortem

    def begin_run(self, run: Run) -> None:
        """Go on with a fresh ``run`` (a live session's next task, or its time between tasks):
        nothing the last run collected or noticed carries over but what ``run`` was given."""
        self.current = run

    def start_and_watch(self) -> None:
        """Start every rank and read them until the run ends (raising the timeout's error if
        ``timeout`` passes first)."""
        __tracebackhide__ = True
        self._start_all()
        timeout = self.plan.timeout
        deadline = None if timeout is None else time.monotonic() + timeout
        if self.watch(deadline):
            raise self._timeout_error()

    @property
    def imports(self) -> set[str]:
        """Modules the run's ranks imported that the kernel lacks (see ``_warm.py``)."""
        return self.current.imports

    # ----------------------------------------------------------------- the attempt
    def run(self) -> RunResult:
        """One launch attempt: start, watch and end every rank; their values, or the run's
        error once every rank is stopped, reaped and drained."""
        __tracebackhide__ = True
        try:
            self.start_and_watch()
            self._drain_and_reap()
            return self.result()
        except BaseException:
            # Failure, timeout or interrupt: stop everything before the exception reaches the
            # cell, so the next launch starts from a clean kernel. A rank kept for a
            # post-mortem stays only if its error carries it (else nobody could release it).
            if not self._post_mortem_given:
                self.held = None
            self.stop_all()
            self._drain_and_reap()
            raise
        finally:
            for rank in self.current.ranks:  # last line of defence (a second interrupt)
                if rank is not self.held:
                    rank.kill(stop=False)
            self.close()

    def set_status(self, rank: Rank, status: RankStatus) -> None:
        """The one place a rank's status changes; the live view hears of every change."""
        was_final = rank.finished
        rank.outcome.status = status
        if status == "ok" and not was_final:  # a launch's rank ended well, a live rank is idle
            self.current.first_finish = self.current.first_finish or time.monotonic()
        if self.current.observer is None:
            return
        if status == "running":
            self.current.observer.started(rank.index)
        elif status in FINAL and not was_final:
            self.current.observer.finished(rank.index, rank.outcome)

    # ----------------------------------------------------------------- start
    def _start_all(self) -> None:
        """Start every rank (where the host runs them), then watch its pipes."""
        try:
            self._lifeline = self.host.start(self.plan, self.rank_envs, self.ranks)
        finally:
            for rank in self.ranks:
                self._pump.add(rank)

    # ----------------------------------------------------------------- watch
    def watch(self, deadline: float | None) -> bool:
        """Pump events until every rank has ended. Returns True if the deadline passed."""
        run = self.current
        while not all(rank.finished for rank in run.ranks):
            now = time.monotonic()
            if _watchdogs.late(deadline, run.paused_for, now) and any(
                rank.alive for rank in run.ranks
            ):
                return True
            # A rank whose pipes closed is exiting and no event will wake the select: reap it
            # within milliseconds, not a whole poll interval (~0.1 s per launch).
            exiting = any(rank.alive and rank.control_closed_at is not None for rank in run.ranks)
            wait = _watchdogs.next_wait(
                self.plan.poll_interval, exiting, deadline, run.paused_for, now
            )
            self.read(wait)
            self._answer_debuggers()
            self.poll_processes()
            self._flush_stale_partials()
            self._check_failures()
            self._check_rendezvous()
            self._check_stragglers()
            if self.current.policy.watch is not None:
                self.current.policy.watch()
            if self.current.observer is not None:
                self.current.observer.tick()
        return False

    def read(self, wait: float) -> None:
        """Read the ranks' pipes for up to ``wait`` s (``_pump.Pump``)."""
        router = self.current.router
        self._pump(wait, router, self._handle, router.notice)

    def read_until(
        self, done: Callable[[], bool], seconds: float, each: Callable[[], None] | None = None
    ) -> bool:
        """Read and notice ended ranks until ``done()`` or ``seconds`` pass; whether done.
        ``each`` runs after every read (e.g. an interrupt sent again)."""
        deadline = time.monotonic() + seconds
        while not done():
            if time.monotonic() >= deadline:
                return False
            self.read(0.02)
            self.poll_processes()
            if each is not None:
                each()
        return True

    def _handle(self, rank: Rank, message: _protocol.Message) -> None:
        """A rank's control message: the rank turns it into state, its status changes here."""
        status = rank.handle(
            message,
            self.current.router,
            self.current.observer,
            self.current.reports,
            self.current.imports,
        )
        if status is not None:
            self.set_status(rank, status)
        if isinstance(message, _protocol.Rendezvous) and all(
            rank.rendezvous.done for rank in self.current.ranks
        ):
            # Decided as the last "done" arrives: a later init_process_group in the function
            # (after destroy_process_group) is not timed from this one's start.
            self.current.rdzv_complete = True

    def _answer_debuggers(self) -> None:
        """A rank stopped in pdb (``nb_dist.breakpoint``): its prompts are answered from the
        cell, here, before anything else (the others wait in their collectives meanwhile)."""
        for rank in self.current.ranks:
            if rank is self.held or not (rank.debugging or rank.prompt is not None):
                continue
            if rank.failure is not None and not self.current.policy.answers_post_mortems:
                continue  # a launch keeps a failed rank for %debug (see _hold_for_post_mortem)
            began = time.monotonic()
            if self.current.observer is not None:
                self.current.observer.paused(rank.index, True)
            _prompts.converse(rank, self._read_and_poll)
            if self.current.observer is not None and rank.alive:
                self.current.observer.paused(rank.index, False)
            paused = time.monotonic() - began
            self.current.paused_for += paused  # time at a prompt is neither work nor a hang

    def _read_and_poll(self, wait: float) -> None:
        """Read the pipes, then notice ranks that ended (a debugger waits on both)."""
        self.read(wait)
        self.poll_processes()

    def poll_processes(self) -> None:
        """Notice the current run's ranks that ended (a rank never started is ``stopped``)."""
        now = time.monotonic()
        for rank in self.current.ranks:
            if rank.process is None:  # never started (the start of an earlier rank failed)
                if not rank.finished:
                    self.set_status(rank, "stopped")
                continue
            poll_exit(rank, now)
            if not rank.finished and not rank.alive:
                control_done = rank.control_closed_at is not None
                if control_done or now - (rank.exited_at or now) > DRAIN_AFTER_EXIT:
                    self._finalize(rank)

    def _finalize(self, rank: Rank) -> None:
        """Decide a finished rank's outcome (its control pipe is drained by now)."""
        self.set_status(rank, rank.settle())

    def _flush_stale_partials(self) -> None:
        """Show a partial line that has waited ``PARTIAL_LINE_AFTER`` s (a progress bar)."""
        now = time.monotonic()
        for rank in self.current.ranks:
            for kind, splitter in rank.splitters.items():
                since = splitter.pending_since
                if since is not None and now - since > PARTIAL_LINE_AFTER:
                    self.current.router.lines(rank.index, kind, splitter.flush())

    def _check_failures(self) -> None:
        """The failure watchdog: the run's policy reacts, or (a launch) the first failed
        rank is held for a post-mortem if asked and every other rank is stopped."""
        if self.current.policy.on_failure is not None:
            self.current.policy.on_failure()
            return
        if self.current.failure_seen:
            return
        for rank in self.current.ranks:
            failed_exit = not rank.alive and rank.returncode not in (None, 0)
            if (
                rank.failure is not None
                or (failed_exit and not rank.stop_requested)
                or (rank.outcome.status == "failed")
            ):
                self._hold_for_post_mortem(rank)
                self.stop_for_failure()
                return

    def stop_for_failure(self) -> None:
        """The run's owner found a failure it cannot go on from: stop every rank, and handle
        no other failure of this run."""
        self.current.failure_seen = True
        self.stop_all()

    def _hold_for_post_mortem(self, rank: Rank) -> None:
        """``debug="postmortem"``: the first rank to fail stays at its exception, not stopped."""
        if self.plan.debug != "postmortem" or rank.failure is None or not rank.alive:
            return
        self.held = rank
        self.set_status(rank, rank.settle())

    def _check_stragglers(self) -> None:
        """Show a notice for each rank still running ``hang_notice_after`` s after the first
        finished (``_run_errors.straggler_notices``)."""
        notices = _run_errors.straggler_notices(
            self.current, self.plan.hang_notice_after, self.stacks
        )
        for notice in notices:
            self.current.router.notice(notice)

    def _check_rendezvous(self) -> None:
        """Stop a rendezvous that has not completed ``rendezvous_timeout`` s after it began."""
        limit = self.plan.rendezvous_timeout
        entered = [
            rank.rendezvous.entered_at for rank in self.current.ranks if rank.rendezvous.entered_at
        ]
        if limit is None or not entered or self.current.rdzv_complete:
            return
        if self.current.failure_seen:
            return  # a rank failed: the failure report explains, not the rendezvous
        if all(rank.rendezvous.done for rank in self.current.ranks):
            self.current.rdzv_complete = True
        elif _watchdogs.rendezvous_overdue(entered, limit, time.monotonic()):
            assert limit is not None
            live, frames = self._stop_with_stacks()
            raise _run_errors.rendezvous_error(self.current, limit, live, frames, time.monotonic())

    # ----------------------------------------------------------------- stacks
    def stacks(self, ranks: list[Rank]) -> _run_errors.Stacks:
        """Ask live ranks for their Python stacks (SIGUSR1 → faulthandler) and parse them,
        reading the pipes meanwhile (``_run_errors.stacks``)."""
        return _run_errors.stacks(ranks, self.read)

    # ----------------------------------------------------------------- stop
    def stop_all(self) -> None:
        """Stop every live rank of the current run but a held one (``_teardown.stop``)."""
        live = [rank for rank in self.current.ranks if rank.alive and rank is not self.held]
        _teardown.stop(live, self.read_until)

    def _drain_and_reap(self) -> None:
        """Read the current run's ranks to their end, reap them (``_teardown``)."""
        _teardown.drain_and_reap(
            self.current.ranks, self.current.router, self.read_until, self._finalize
        )

    def close(self) -> None:
        """Stop reading and close the kernel's pipe ends, the lifeline and the host; a held
        rank's stay open for its post-mortem (``_teardown.close``)."""
        _teardown.close(self.ranks, self._pump, self.held, self._lifeline, self.host.close)

    # ----------------------------------------------------------------- results
    def result(self) -> RunResult:
        """The current run's values, or raise its root cause (a post-mortem attached if a
        failed rank is held at its prompt)."""
        __tracebackhide__ = True
        outcomes = [rank.outcome for rank in self.current.ranks]
        if all(o.status == "ok" for o in outcomes):
            return RunResult(
                values=[rank.value for rank in self.current.ranks],
                reports=self.current.reports,
                outcomes=outcomes,
                durations=[o.duration for o in outcomes],
            )
        root, collateral = _diagnosis.root_cause(outcomes)
        for rank in self.current.ranks:
            if rank.outcome in collateral:
                self.set_status(rank, "collateral")
        logs = _run_errors.logs(self.current)  # before a held rank's debugger says more
        held = self._held_at_its_prompt()
        error = _run_errors.failure_error(self.current, root, logs, held)
        if held is not None:
            error.post_mortem = _prompts.PostMortem(
                held, self._lifeline, self.current.router, self.host.close
            )
            self._post_mortem_given = True
            _prompts.hook_debug_magic()
        raise error

    def _held_at_its_prompt(self) -> Rank | None:
        """The held rank once its debugger has asked for a command (within 2 s); a rank that
        never gets there (it failed before its function ran, so has no frames) is let go."""
        held = self.held
        if held is not None:
            self.read_until(
                lambda: (
                    not held.alive or held.prompt is not None or held.control_closed_at is not None
                ),
                2.0,
            )
        if held is None or held.prompt is None or not held.alive:
            self.held = None  # stopped with the others (run's finally)
            return None
        return held

    def _stop_with_stacks(self) -> tuple[list[Rank], dict[int, list[_diagnosis.Frame]]]:
        """Take the stacks of the live ranks, then stop everything: (who was live, stacks)."""
        live = [rank for rank in self.current.ranks if rank.alive]
        frames = self.stacks(live)
        self.stop_all()
        self._drain_and_reap()
        return live, frames

    def _timeout_error(self) -> LaunchTimeoutError:
        """Stop every rank, their stacks taken first, and build the ``timeout``'s error."""
        live, frames = self._stop_with_stacks()
        timeout = self.plan.timeout or 0.0
        return _run_errors.timeout_error(self.current, timeout, live, frames, self.counter_file)

    def counter_file(self, rank: Rank) -> str | None:
        """The rank's collective counter file (``_collectives.py``), if it has one."""
        return self.rank_envs[rank.index].get(COLLECTIVES_ENV)
