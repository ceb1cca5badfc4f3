"""The kernel side of one launch attempt: start the workers, watch them, stop them.

Everything here runs in the thread that called the launcher (the cell's thread), in one
``select`` loop: worker output is written by that thread, so it lands in the launching cell;
an interrupt arrives there as ``KeyboardInterrupt`` and tears the workers down; and every
worker is reaped and every pipe drained before control returns to the cell.

How a worker is started and reaped is in ``_processes.py``, what it says on its control pipe
in ``_protocol.py``, and what a stuck or failed launch means in ``_diagnosis.py``. A rank's
status changes in one place, :meth:`Supervisor._set_status`.
"""

from __future__ import annotations

import contextlib
import selectors
import signal
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any, TypeVar

from . import _diagnosis, _prompts, _protocol, _start
from ._errors import LaunchError as _LaunchError
from ._errors import (
    LaunchTimeoutError,
    RankOutcome,
    RankStatus,
    RendezvousTimeoutError,
    WorkerFailedError,
)
from ._output import OutputRouter
from ._plan import LaunchPlan
from ._rank import FINAL, Rank
from ._reporting import Reports
from ._worker import COLLECTIVES_ENV, WorkerSpec

# How long a stopped worker gets between SIGTERM and SIGKILL; keeps "stopped within 1 s".
STOP_GRACE = 0.4
# How long to keep reading a dead worker's pipes (a grandchild may hold them open).
DRAIN_AFTER_EXIT = 1.0
# A partial line (no newline yet) is shown after this long anyway.
PARTIAL_LINE_AFTER = 1.0
_Error = TypeVar("_Error", bound=_LaunchError)


@dataclass
class AttemptResult:
    values: list[Any]
    reports: Reports
    outcomes: list[RankOutcome]
    durations: list[float | None]


class Supervisor:
    """Runs one attempt: ``run()`` returns per-rank values or raises a launch error."""

    #: A failed rank's pdb is answered in the cell (live ranks), not kept for ``%debug``.
    answers_post_mortems = False

    def __init__(
        self,
        plan: LaunchPlan,
        worker_env: list[dict[str, str]],
        router: OutputRouter,
        observer: Any,
    ) -> None:
        self.config = plan
        self.worker_env = worker_env
        self.router = router
        self.observer = observer  # a live view (the launch monitor), or None
        self.workers = [Rank(i, r) for i, r in enumerate(plan.ranks)]
        self.reports = Reports()
        #: Modules the workers imported that the kernel lacks (see nb_dist/_warm.py).
        self.imports: set[str] = set()
        self._selector = selectors.DefaultSelector()
        self._lifeline: Connection | None = None  # its EOF tells the workers the kernel died
        self._first_finish: float | None = None
        self._hang_noticed: set[int] = set()
        self._failure_seen = False
        self._rdzv_complete = False
        #: Seconds spent waiting for the notebook to answer a debugger (not counted as work).
        self.paused_for = 0.0
        #: The failed rank kept for a post-mortem (``debug="postmortem"``), if any.
        self.held: Rank | None = None
        self._post_mortem_given = False  # the held rank went to the error's PostMortem

    # ----------------------------------------------------------------- the attempt
    def run(self) -> AttemptResult:
        __tracebackhide__ = True
        try:
            self._start_all()
            timeout = self.config.timeout
            deadline = None if timeout is None else time.monotonic() + timeout
            if self._watch(deadline):
                raise self._timeout_error()
            self._drain_and_reap()
            return self._result()
        except BaseException:
            # Failure, timeout or interrupt: stop everything before the exception reaches the
            # cell, so the next launch starts from a clean kernel. A rank kept for a
            # post-mortem stays only if its error carries it (else nobody could release it).
            if not self._post_mortem_given:
                self.held = None
            self._stop_all()
            self._drain_and_reap()
            raise
        finally:
            for worker in self.workers:  # last line of defence (a second interrupt)
                if worker.alive and worker.process is not None and worker is not self.held:
                    worker.returncode = worker.process.kill_and_reap()
            self._close()

    def _set_status(self, worker: Rank, status: RankStatus) -> None:
        """The one place a rank's status changes; the live view hears of every change."""
        was_final = worker.finished
        worker.outcome.status = status
        if self.observer is None:
            return
        if status == "running":
            self.observer.started(worker.local_rank)
        elif status in FINAL and not was_final:
            self.observer.finished(worker.local_rank, worker.outcome)

    # ----------------------------------------------------------------- start
    def _start_all(self) -> None:
        """Start every rank (``_start.py``), then watch its pipes."""
        plan = self.config

        def spec_for(local_rank: int, kernel_fds: list[int]) -> WorkerSpec:
            return plan.worker_spec(local_rank, self.worker_env[local_rank], kernel_fds)

        try:
            self._lifeline = _start.start_all(plan.start_method, self.workers, spec_for)
        finally:
            for worker in self.workers:
                for kind, reader in worker.pipes.items():
                    self._selector.register(reader.fileno(), selectors.EVENT_READ, (worker, kind))

    # ----------------------------------------------------------------- watch
    def _watch(self, deadline: float | None) -> bool:
        """Pump events until every worker has ended. Returns True if the deadline passed."""
        while not all(w.finished for w in self.workers):
            now = time.monotonic()
            late = deadline is not None and now >= deadline + self.paused_for
            if late and any(w.alive for w in self.workers):
                return True
            wait = self.config.poll_interval
            if any(w.alive and w.control_closed_at is not None for w in self.workers):
                # Its pipes are closed, so it is exiting, and no event will wake the select:
                # reap it within milliseconds, not a whole poll interval (~0.1 s per launch).
                wait = min(wait, 0.002)
            if deadline is not None:
                wait = max(0.0, min(wait, deadline + self.paused_for - now))
            self._pump(wait)
            self._answer_debuggers()
            self._poll_processes()
            self._flush_stale_partials()
            self._check_failures()
            self._check_rendezvous()
            self._check_stragglers()
            if self.observer is not None:
                self.observer.tick()
        return False

    def _pump(self, wait: float) -> None:
        for key, _ in self._selector.select(timeout=wait):
            worker, kind = key.data
            if kind != "control":
                if not worker.read_stream(kind, self.router):
                    self._unregister(worker.pipes[kind])
                continue
            try:
                message = worker.read_message()
            except Exception as exc:
                self.router.notice(
                    f"could not read a message from rank {worker.outcome.rank} "
                    f"({type(exc).__name__}: {exc})."
                )
                continue
            if message is None:
                self._unregister(worker.pipes["control"])
            else:
                self._handle(worker, message)

    def _handle(self, worker: Rank, message: _protocol.Message) -> None:
        status = worker.handle(message, self.router, self.observer, self.reports, self.imports)
        if status is not None:
            self._set_status(worker, status)
        if isinstance(message, _protocol.Rendezvous) and all(
            w.rendezvous.done for w in self.workers
        ):
            # Decided as the last "done" arrives: a later init_process_group in the function
            # (after destroy_process_group) is not timed from this one's start.
            self._rdzv_complete = True

    def _answer_debuggers(self) -> None:
        """A rank stopped in pdb (``nb_dist.breakpoint``): its prompts are answered from the
        cell, here, before anything else (the others wait in their collectives meanwhile)."""
        for worker in self.workers:
            if worker is self.held or not (worker.debugging or worker.prompt is not None):
                continue
            if worker.failure is not None and not self.answers_post_mortems:
                continue  # a launch keeps a failed rank for %debug (see _hold_for_post_mortem)
            began = time.monotonic()
            if self.observer is not None:
                self.observer.paused(worker.local_rank, True)
            _prompts.converse(worker, self._pump_and_poll)
            if self.observer is not None and worker.alive:
                self.observer.paused(worker.local_rank, False)
            self.paused_for += time.monotonic() - began

    def _pump_and_poll(self, wait: float) -> None:
        """Read the pipes, then notice ranks that ended (a debugger waits on both)."""
        self._pump(wait)
        self._poll_processes()

    def _unregister(self, conn: Connection) -> None:
        with contextlib.suppress(KeyError, ValueError):
            self._selector.unregister(conn.fileno())

    def _poll_processes(self) -> None:
        now = time.monotonic()
        for worker in self.workers:
            if worker.process is None:  # never started (the start of an earlier rank failed)
                if not worker.finished:
                    self._set_status(worker, "stopped")
                continue
            if worker.alive:
                code = worker.process.exit_code()
                if code is not None:
                    worker.returncode, worker.exited_at = code, now
            if not worker.finished and not worker.alive:
                control_done = worker.control_closed_at is not None
                if control_done or now - (worker.exited_at or now) > DRAIN_AFTER_EXIT:
                    self._finalize(worker)

    def _finalize(self, worker: Rank) -> None:
        """Decide a finished worker's outcome (its control pipe is drained by now)."""
        status = worker.settle()
        if status == "ok":
            self._first_finish = self._first_finish or time.monotonic()
        self._set_status(worker, status)

    def _flush_stale_partials(self) -> None:
        now = time.monotonic()
        for worker in self.workers:
            for kind, splitter in worker.splitters.items():
                since = splitter.pending_since
                if since is not None and now - since > PARTIAL_LINE_AFTER:
                    self.router.lines(worker.local_rank, kind, splitter.flush())

    def _check_failures(self) -> None:
        if self._failure_seen:
            return
        for worker in self.workers:
            failed_exit = not worker.alive and worker.returncode not in (None, 0)
            if (
                worker.failure is not None
                or (failed_exit and not worker.stop_requested)
                or (worker.outcome.status == "failed")
            ):
                self._failure_seen = True
                self._hold_for_post_mortem(worker)
                self._stop_all()
                return

    def _hold_for_post_mortem(self, worker: Rank) -> None:
        """``debug="postmortem"``: the first rank to fail stays at its exception, not stopped."""
        if self.config.debug != "postmortem" or worker.failure is None or not worker.alive:
            return
        self.held = worker
        self._set_status(worker, worker.settle())

    def _check_stragglers(self) -> None:
        limit = self.config.hang_notice_after
        if limit is None or self._first_finish is None:
            return
        waited = time.monotonic() - self._first_finish
        if waited < limit:
            return
        finished = [w.outcome.rank for w in self.workers if w.outcome.status == "ok"]
        for worker in self.workers:
            if not worker.alive or worker.local_rank in self._hang_noticed:
                continue
            self._hang_noticed.add(worker.local_rank)
            returned = worker.outcome.returned_at
            if returned is not None:
                ago = time.monotonic() - returned
                self.router.notice(_diagnosis.teardown_notice(worker.outcome.rank, ago))
                continue
            frames = self._stacks([worker]).get(worker.local_rank, [])
            notice = _diagnosis.straggler_notice(worker.outcome.rank, waited, finished, frames)
            self.router.notice(notice)

    def _check_rendezvous(self) -> None:
        """Stop a rendezvous that has not completed ``rendezvous_timeout`` s after it began."""
        limit = self.config.rendezvous_timeout
        entered = [w.rendezvous.entered_at for w in self.workers if w.rendezvous.entered_at]
        if limit is None or not entered or self._rdzv_complete:
            return
        if self._failure_seen:
            return  # a rank failed: the failure report explains, not the rendezvous
        if all(w.rendezvous.done for w in self.workers):
            self._rdzv_complete = True
        elif time.monotonic() - min(entered) >= limit:
            raise self._rendezvous_error(limit)

    # ----------------------------------------------------------------- stacks
    def _stacks(self, workers: list[Rank]) -> dict[int, list[_diagnosis.Frame]]:
        """Ask live workers for their Python stacks (SIGUSR1 → faulthandler) and parse them."""
        asked = [worker for worker in workers if worker.ask_for_stack()]
        deadline = time.monotonic() + 0.5
        quiet_since: float | None = None
        while asked and time.monotonic() < deadline:
            before = sum(len(w.stack) for w in asked)
            self._pump(0.02)
            if all(w.stack for w in asked) and sum(len(w.stack) for w in asked) == before:
                quiet_since = quiet_since or time.monotonic()
                if time.monotonic() - quiet_since > 0.05:
                    break
            else:
                quiet_since = None
        return {worker.local_rank: worker.read_stack() for worker in asked}

    # ----------------------------------------------------------------- stop
    def _stop_all(self) -> None:
        """SIGTERM every live worker's process group, then SIGKILL what is left after a grace."""
        live = [w for w in self.workers if w.alive and w is not self.held]
        for worker in live:
            worker.stop_requested = True
            assert worker.process is not None
            worker.process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + STOP_GRACE
        while time.monotonic() < deadline and any(w.alive for w in live):
            self._pump(0.02)
            self._poll_processes()
        for worker in live:
            if worker.alive and worker.process is not None:
                worker.process.send_signal(signal.SIGKILL)

    def _drain_and_reap(self) -> None:
        deadline = time.monotonic() + DRAIN_AFTER_EXIT + STOP_GRACE
        while not all(w.finished for w in self.workers):
            if time.monotonic() > deadline:
                for worker in self.workers:
                    if worker.alive and worker.process is not None:
                        worker.stop_requested = True
                        worker.returncode = worker.process.kill_and_reap()
                        worker.exited_at = time.monotonic()
                    if not worker.finished:
                        self._finalize(worker)
                break
            self._pump(0.02)
            self._poll_processes()
        for worker in self.workers:
            for kind, splitter in worker.splitters.items():
                self.router.lines(worker.local_rank, kind, splitter.flush())

    def _close(self) -> None:
        for worker in self.workers:
            for conn in worker.pipes.values():
                self._unregister(conn)
                if worker is not self.held:
                    conn.close()
            if worker.commands is not None and worker is not self.held:
                worker.commands.close()
        self._selector.close()
        if self.held is not None and self.held.alive:
            return  # the lifeline now belongs to the post-mortem (see _result)
        if self._lifeline is not None and not self._lifeline.closed:
            self._lifeline.close()

    # ----------------------------------------------------------------- results
    def _result(self) -> AttemptResult:
        outcomes = [w.outcome for w in self.workers]
        if all(o.status == "ok" for o in outcomes):
            return AttemptResult(
                values=[w.value for w in self.workers],
                reports=self.reports,
                outcomes=outcomes,
                durations=[o.duration for o in outcomes],
            )
        root, collateral = _diagnosis.root_cause(outcomes)
        for worker in self.workers:
            if worker.outcome in collateral:
                self._set_status(worker, "collateral")
        logs = self._logs()
        message = _diagnosis.failure_message(root, outcomes, logs[root.local_rank])
        held = self._held_at_its_prompt()
        if held is not None:
            message += "\n\n" + _diagnosis.post_mortem_note(held.outcome.rank)
        note = self._failure_note()
        if note:
            message += "\n\n" + note
        error = WorkerFailedError(message, root, outcomes, logs)
        if held is not None:
            error.post_mortem = _prompts.PostMortem(held, self._lifeline, self.router)
            self._post_mortem_given = True
            _prompts.hook_debug_magic()
        return self._raise(error)

    def _failure_note(self) -> str:
        """A last paragraph for a failure's message (live ranks: the session's state)."""
        return ""

    def _stuck_views(
        self, live: list[Rank], frames: dict[int, list[_diagnosis.Frame]]
    ) -> list[_diagnosis.StuckRank]:
        """Every rank for a timeout report: where the live ones were, their collectives."""
        return [
            w.stuck_view(w in live, frames.get(w.local_rank), self.counter_file(w))
            for w in self.workers
        ]

    def _held_at_its_prompt(self) -> Rank | None:
        """The held rank once its debugger has asked for a command (within 2 s); a rank that
        never gets there (it failed before its function ran, so has no frames) is let go."""
        held = self.held
        deadline = time.monotonic() + 2.0
        while held is not None and held.alive and held.prompt is None:
            if time.monotonic() > deadline or held.control_closed_at is not None:
                break
            self._pump_and_poll(0.02)
        if held is None or held.prompt is None or not held.alive:
            self.held = None  # stopped with the others (run's finally)
            return None
        return held

    def _stop_with_stacks(self) -> tuple[list[Rank], dict[int, list[_diagnosis.Frame]]]:
        """Take the stacks of the live ranks, then stop everything: (who was live, stacks)."""
        live = [w for w in self.workers if w.alive]
        frames = self._stacks(live)
        self._stop_all()
        self._drain_and_reap()
        return live, frames

    def _timeout_error(self) -> LaunchTimeoutError:
        live, frames = self._stop_with_stacks()
        views = self._stuck_views(live, frames)
        timeout = self.config.timeout or 0.0
        text, stacks = _diagnosis.timeout_report(timeout, views)
        outcomes = [w.outcome for w in self.workers]
        return self._with_reports(LaunchTimeoutError(text, timeout, stacks, outcomes, self._logs()))

    def _rendezvous_error(self, limit: float) -> RendezvousTimeoutError:
        live, frames = self._stop_with_stacks()
        now = time.monotonic()
        views = [w.rendezvous_view(now, w in live, frames.get(w.local_rank)) for w in self.workers]
        text, stacks = _diagnosis.rendezvous_report(limit, len(self.workers), views)
        outcomes = [w.outcome for w in self.workers]
        error = RendezvousTimeoutError(text, limit, stacks, outcomes, self._logs())
        return self._with_reports(error)

    def counter_file(self, worker: Rank) -> str | None:
        """The rank's collective counter file (``_collectives.py``), if it has one."""
        return self.worker_env[worker.local_rank].get(COLLECTIVES_ENV)

    def _logs(self) -> list[str]:
        return [self.router.log_text(w.local_rank) for w in self.workers]

    def _with_reports(self, error: _Error) -> _Error:
        error.reports = self.reports
        return error

    def _raise(self, error: WorkerFailedError) -> AttemptResult:
        __tracebackhide__ = True
        raise self._with_reports(error)
