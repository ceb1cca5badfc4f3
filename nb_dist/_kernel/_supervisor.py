"""The kernel side of one launch attempt: start the ranks, watch them, stop them.

Everything here runs in the thread that called the launcher (the cell's thread), in one
``select`` loop: rank output is written by that thread, so it lands in the launching cell;
an interrupt arrives there as ``KeyboardInterrupt`` and tears the ranks down; and every
rank is reaped and every pipe drained before control returns to the cell.

Where the ranks run is the supervisor's one injected part, its :class:`RankHost`: this
machine (``_local.LocalHost``) or a cluster's node agents (``_cluster/_remote_run.ClusterHost``);
the loop, the output, the diagnosis and the results are the same for both. How a run treats
a failure is the other: its :class:`~_pump.Policy` (``policy=``, a launch's by default).

A launch calls :meth:`Supervisor.run`. Live ranks (``_live/_session.py``) hold a supervisor
and drive its loop task by task through a small public surface (see :class:`Supervisor`);
the rest stays private. How a rank is started and reaped is in ``_processes.py``, what it
says on its control pipe in ``_protocol.py``, and what a stuck or failed launch means in
``_diagnosis.py``. A rank's status changes in one place, :meth:`Supervisor.set_status`.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any, Protocol, TypeVar

from .._shared import _protocol
from .._shared._protocol import COLLECTIVES_ENV
from .._shared._reporting import Reports
from .._starter._processes import REAP_WITHIN
from .._starter._run_parts import DRAIN_AFTER_EXIT
from . import _diagnosis, _prompts, _watchdogs
from ._errors import LaunchError as _LaunchError
from ._errors import (
    LaunchTimeoutError,
    RankOutcome,
    RankStatus,
    RendezvousTimeoutError,
    WorkerFailedError,
)
from ._observer import Observer
from ._output import OutputRouter
from ._plan import LaunchPlan
from ._pump import LAUNCH, Policy, Pump, Run, poll_exit
from ._rank_handle import FINAL, Rank

# How long a stopped rank gets between SIGTERM and SIGKILL; keeps "stopped within 1 s".
STOP_GRACE = 0.4
# A partial line (no newline yet) is shown after this long anyway.
PARTIAL_LINE_AFTER = 1.0
_Error = TypeVar("_Error", bound=_LaunchError)


@dataclass
class RunResult:
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
    and drives it with the loop's operations: ``start_and_watch``, ``watch``, ``read``,
    ``read_until``, ``poll_processes``, ``set_status``, ``stop_all``, ``stop_for_failure``,
    ``mute_view``, ``close``, and what it reads of the ranks (``stacks``, ``stuck_views``,
    ``counter_file``, ``result``, ``logs``, ``with_reports``); its state: ``plan``,
    ``host``, ``ranks``, ``held``.
    """

    def __init__(
        self,
        plan: LaunchPlan,
        rank_envs: list[dict[str, str]],
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
        self.ranks = [
            Rank(i, r, int(env["LOCAL_RANK"]) if "LOCAL_RANK" in env else None)
            for i, (r, env) in enumerate(zip(plan.ranks, rank_envs, strict=True))
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

    def begin_run(
        self,
        ranks: list[Rank],
        router: OutputRouter,
        policy: Policy,
        reports: Reports | None = None,
        observer: Observer | None = None,
    ) -> Run:
        """Start a fresh run over ``ranks`` (a live session's next task, or its time between
        tasks): nothing the last run collected or noticed carries over but ``reports``."""
        self.current = Run(
            ranks, router, observer, reports if reports is not None else Reports(), policy
        )
        return self.current

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
        now = time.monotonic()
        for rank in self.current.ranks:
            for kind, splitter in rank.splitters.items():
                since = splitter.pending_since
                if since is not None and now - since > PARTIAL_LINE_AFTER:
                    self.current.router.lines(rank.index, kind, splitter.flush())

    def _check_failures(self) -> None:
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

    def mute_view(self) -> None:
        """The run's live view hears no more of it (what follows is not the cell's work)."""
        self.current.observer = None

    def _hold_for_post_mortem(self, rank: Rank) -> None:
        """``debug="postmortem"``: the first rank to fail stays at its exception, not stopped."""
        if self.plan.debug != "postmortem" or rank.failure is None or not rank.alive:
            return
        self.held = rank
        self.set_status(rank, rank.settle())

    def _check_stragglers(self) -> None:
        limit = self.plan.hang_notice_after
        waited = _watchdogs.straggler_wait(self.current.first_finish, limit, time.monotonic())
        if waited is None:
            return
        finished = [rank.outcome.rank for rank in self.current.ranks if rank.outcome.status == "ok"]
        for rank in self.current.ranks:
            noticed = rank.index in self.current.hang_noticed
            if rank.finished or not rank.alive or noticed:
                continue
            self.current.hang_noticed.add(rank.index)
            returned = rank.outcome.returned_at
            if returned is not None:
                ago = time.monotonic() - returned
                self.current.router.notice(_diagnosis.teardown_notice(rank.outcome.rank, ago))
                continue
            frames = self.stacks([rank]).get(rank.index, [])
            notice = _diagnosis.straggler_notice(
                rank.outcome.rank, waited, finished, frames, self.current.policy.limit_hint
            )
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
            raise self._rendezvous_error(limit)

    # ----------------------------------------------------------------- stacks
    def stacks(self, ranks: list[Rank]) -> dict[int, list[_diagnosis.Frame]]:
        """Ask live ranks for their Python stacks (SIGUSR1 → faulthandler) and parse them."""
        asked = [rank for rank in ranks if rank.ask_for_stack()]
        deadline = time.monotonic() + 0.5
        quiet_since: float | None = None
        while asked and time.monotonic() < deadline:
            before = sum(len(rank.stack) for rank in asked)
            self.read(0.02)
            if (
                all(rank.stack for rank in asked)
                and sum(len(rank.stack) for rank in asked) == before
            ):
                quiet_since = quiet_since or time.monotonic()
                if time.monotonic() - quiet_since > 0.05:
                    break
            else:
                quiet_since = None
        return {rank.index: rank.read_stack() for rank in asked}

    # ----------------------------------------------------------------- stop
    def stop_all(self) -> None:
        """SIGTERM every live rank's process group, then SIGKILL what is left after a grace."""
        live = [rank for rank in self.current.ranks if rank.alive and rank is not self.held]
        for rank in live:
            rank.request_stop()
            assert rank.process is not None
            rank.process.send_signal(signal.SIGTERM)
        self.read_until(lambda: not any(rank.alive for rank in live), STOP_GRACE)
        for rank in live:
            if rank.alive and rank.process is not None:
                rank.process.send_signal(signal.SIGKILL)

    def _drain_and_reap(self) -> None:
        ranks = self.current.ranks
        if not self.read_until(
            lambda: all(rank.finished for rank in ranks), DRAIN_AFTER_EXIT + STOP_GRACE
        ):
            # Every group killed at once, then all reaped by one deadline: a teardown waits
            # REAP_WITHIN at most, however many ranks are stuck.
            for rank in ranks:
                if rank.alive and rank.process is not None:
                    rank.request_stop()
                    rank.process.send_signal(signal.SIGKILL)
            deadline = time.monotonic() + REAP_WITHIN
            for rank in ranks:
                rank.kill(by=deadline)
                if not rank.finished:
                    self._finalize(rank)
        for rank in ranks:
            rank.drain_streams(self.current.router)  # its last lines, if still in the pipe
            for kind, splitter in rank.splitters.items():
                self.current.router.lines(rank.index, kind, splitter.flush())

    def close(self) -> None:
        """Stop reading and close the kernel's pipe ends (a held rank's stay open), then the
        lifeline and the host, unless a held rank's post-mortem ends them later."""
        for rank in self.ranks:
            for conn in rank.pipes.values():
                self._pump.remove(conn)
                if rank is not self.held:
                    conn.close()
            if rank.commands is not None and rank is not self.held:
                rank.commands.close()
        self._pump.close()
        if self.held is not None and self.held.alive:
            return  # the lifeline and the host now end with the post-mortem (see _result)
        if self._lifeline is not None and not self._lifeline.closed:
            self._lifeline.close()
        self.host.close()

    # ----------------------------------------------------------------- results
    def result(self) -> RunResult:
        """The current run's values, or raise its root cause (a post-mortem attached if a
        failed rank is held at its prompt)."""
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
        logs = self.logs()
        # The root's log by its place among this kernel's ranks (its LOCAL_RANK is its place
        # on its node: on a cluster every node has a LOCAL_RANK 0).
        root_log = logs[next(i for i, o in enumerate(outcomes) if o is root)]
        message = _diagnosis.failure_message(root, outcomes, root_log)
        held = self._held_at_its_prompt()
        if held is not None:
            message += "\n\n" + _diagnosis.post_mortem_note(held.outcome.rank)
        closing = self.current.policy.closing_note
        note = closing() if closing is not None else ""
        if note:
            message += "\n\n" + note
        error = WorkerFailedError(message, root, outcomes, logs)
        if held is not None:
            error.post_mortem = _prompts.PostMortem(
                held, self._lifeline, self.current.router, self.host.close
            )
            self._post_mortem_given = True
            _prompts.hook_debug_magic()
        return self._raise(error)

    def stuck_views(
        self, live: list[Rank], frames: dict[int, list[_diagnosis.Frame]]
    ) -> list[_diagnosis.StuckRank]:
        """Every rank for a timeout report: where the live ones were, their collectives."""
        return [
            rank.stuck_view(rank in live, frames.get(rank.index), self.counter_file(rank))
            for rank in self.current.ranks
        ]

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
        live, frames = self._stop_with_stacks()
        views = self.stuck_views(live, frames)
        timeout = self.plan.timeout or 0.0
        text, stacks = _diagnosis.timeout_report(timeout, views)
        outcomes = [rank.outcome for rank in self.current.ranks]
        return self.with_reports(LaunchTimeoutError(text, timeout, stacks, outcomes, self.logs()))

    def _rendezvous_error(self, limit: float) -> RendezvousTimeoutError:
        live, frames = self._stop_with_stacks()
        now = time.monotonic()
        views = [
            rank.rendezvous_view(now, rank in live, frames.get(rank.index))
            for rank in self.current.ranks
        ]
        text, stacks = _diagnosis.rendezvous_report(limit, len(self.current.ranks), views)
        outcomes = [rank.outcome for rank in self.current.ranks]
        error = RendezvousTimeoutError(text, limit, stacks, outcomes, self.logs())
        return self.with_reports(error)

    def counter_file(self, rank: Rank) -> str | None:
        """The rank's collective counter file (``_collectives.py``), if it has one."""
        return self.rank_envs[rank.index].get(COLLECTIVES_ENV)

    def logs(self) -> list[str]:
        """The current run's log text, one per rank, for an error."""
        return [self.current.router.log_text(rank.index) for rank in self.current.ranks]

    def with_reports(self, error: _Error) -> _Error:
        """``error`` carrying the current run's reports."""
        error.reports = self.current.reports
        return error

    def _raise(self, error: WorkerFailedError) -> RunResult:
        __tracebackhide__ = True
        raise self.with_reports(error)
