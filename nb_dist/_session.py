"""The kernel side of live ranks: the supervisor's ranks kept alive across tasks.

A :class:`SessionSupervisor` is a launch's :class:`~_supervisor.Supervisor` whose workers
serve tasks (``_serve.py``) instead of running one function and exiting. It reuses the
supervisor's start, ``select`` loop, output routing, stacks, watchdogs and teardown; what
it adds is the life of one task:

- before a task: every rank alive and idle, and their collective counts in step (a notice
  if not: the next collective may pair different calls and hang);
- a task ends when every rank it ran on sent :class:`~_protocol.Idle`;
- a failure: the other ranks get :data:`FAILURE_GRACE` to end on their own, then an
  interrupt (SIGINT → ``KeyboardInterrupt`` in the task), then :data:`INTERRUPT_GRACE`; a
  rank still running then is blocked where no interrupt reaches it (a collective the failed
  rank never joined), so every rank is stopped and the session is *lost*: its owner restarts it;
- a timeout or the notebook's interrupt: the same interrupt, then the same verdict;
- a rank that dies (a signal, ``os._exit``): the process group cannot survive it, so every
  rank is stopped and the session is lost.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from . import _diagnosis, _protocol
from ._errors import LaunchInterrupted, LaunchTimeoutError
from ._output import OutputRouter
from ._processes import signal_name
from ._rank import Rank
from ._supervisor import AttemptResult, Supervisor

#: After a rank fails, how long the others may take to finish the task on their own.
FAILURE_GRACE = 0.1
#: After an interrupt, how long a rank may take to stop its task (then it is killed).
INTERRUPT_GRACE = 0.7
#: While waiting for interrupted ranks, the interrupt is sent again this often.
REPEAT_INTERRUPT = 0.05
#: How long closed ranks get to destroy their process group and exit.
CLOSE_GRACE = 1.0


@dataclass(frozen=True)
class Lost:
    """Why a session's ranks had to be stopped (its state is gone)."""

    reason: str  # a sentence for the user
    dead_rank: bool  # a rank died by itself (restart() by hand) vs. was stopped


class SessionSupervisor(Supervisor):
    """Ranks that stay up between tasks; ``start()``, then ``task()`` many times, ``close()``."""

    task_count = 0
    lost: Lost | None = None
    _interrupted = False
    _last_interrupt = 0.0
    _in_task = False
    _failed_at: float | None = None
    answers_post_mortems = True  # in the failing cell itself
    _closed = False

    # ----------------------------------------------------------------- life
    def start(self) -> None:
        """Start every rank and wait until each has its process group (or raise)."""
        __tracebackhide__ = True
        self._in_task = False
        try:
            self._start_all()
            timeout = self.config.timeout
            deadline = None if timeout is None else time.monotonic() + timeout
            if self._watch(deadline):
                raise self._timeout_error()
            self._result()  # raises if a rank could not start
            self.router.finish()
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """Let every rank leave (its process group destroyed), kill what does not, reap."""
        if self._closed:
            return
        self._closed = True
        for worker in self.workers:
            if worker.commands is not None and not worker.commands.closed:
                worker.commands.close()  # EOF: the rank's loop ends
        deadline = time.monotonic() + CLOSE_GRACE
        while any(w.alive for w in self.workers) and time.monotonic() < deadline:
            self._pump(0.02)
            self._poll_processes()
        for worker in self.workers:
            if worker.alive and worker.process is not None:
                worker.stop_requested = True
                worker.returncode = worker.process.kill_and_reap()
        self._close()

    @property
    def alive(self) -> bool:
        return self.lost is None and all(w.alive for w in self.workers)

    # ----------------------------------------------------------------- one task
    def check_ready(self) -> str | None:
        """Before a task: ``None``, or a notice that the ranks' collective counts differ."""
        self._poll_processes()
        dead = [w for w in self.workers if not w.alive]
        if dead:
            code = dead[0].returncode
            name = signal_name(-code) if code is not None and code < 0 else None
            how = _diagnosis.ended_without_value(code, name)
            self.lost = Lost(f"rank {dead[0].outcome.rank} ended between cells: {how}", True)
            self.close()
            return None
        busy = [w for w in self.workers if w.idle_task != w.tasks_sent]
        if busy:  # a cell left running (a second interrupt cut its ending short)
            stuck = self._settle(busy)
            if stuck:
                names = ", ".join(str(w.outcome.rank) for w in stuck)
                self.lost = Lost(
                    f"rank {names} was still busy with an earlier cell and could not be "
                    "interrupted", dead_rank=False,
                )  # fmt: skip
                self.close()
                return None
        counts = {w.outcome.rank: w.collectives for w in self.workers}
        if len(set(counts.values())) > 1:
            listed = ", ".join(f"rank {r}: {n}" for r, n in counts.items())
            return (
                f"the ranks are out of step: they have entered different numbers of "
                f"collectives ({listed}). A collective now may pair different calls on "
                "different ranks and wait forever; run it on every rank, or restart()."
            )
        return None

    def task(
        self,
        command_for: Callable[[Rank], _protocol.Command],
        local_ranks: list[int],
        router: OutputRouter,
        observer: Any,
        timeout: float | None,
    ) -> AttemptResult:
        """Run one task on ``local_ranks``: their values, or a launch error (see the module)."""
        __tracebackhide__ = True
        everyone = self.workers
        self.workers = [everyone[i] for i in local_ranks]
        self.router, self.observer = router, observer
        self._failure_seen, self._first_finish, self._hang_noticed = False, None, set()
        self._failed_at = None
        self._interrupted, self._last_interrupt = False, 0.0
        self._in_task = True
        self.paused_for = 0.0
        self.task_count += 1
        try:
            for worker in self.workers:
                worker.begin_task()
                self._set_status(worker, "running")
                worker.tasks_sent += 1
                worker.send(command_for(worker))
            deadline = None if timeout is None else time.monotonic() + timeout
            try:
                timed_out = self._watch(deadline)
            except KeyboardInterrupt:
                raise self._interrupted_error() from None
            if timed_out:
                raise self._task_timeout(timeout or 0.0)
            self._pump(0.0)  # output written just before the last Idle
            for worker in self.workers:
                for kind, splitter in worker.splitters.items():
                    router.lines(worker.local_rank, kind, splitter.flush())
            return self._result()
        finally:
            self._in_task = False
            self.workers = everyone
            router.finish()
            if self.lost is not None:
                self.close()

    def _failure_note(self) -> str:
        return self._note() if self._in_task else ""

    def _note(self) -> str:
        if self.lost is None:
            return "The session is still usable: every rank is idle, with its state."
        return self.lost.reason

    # ----------------------------------------------------------------- failures
    def _check_failures(self) -> None:
        if not self._in_task:
            super()._check_failures()
            return
        dead = [w for w in self.workers if not w.alive and not w.stop_requested]
        if dead and self.lost is None:
            who = dead[0]
            self.lost = Lost(
                f"Rank {who.outcome.rank} died, so its process group cannot go on: every "
                "rank was stopped and their state is lost. Call restart() for fresh ranks.",
                dead_rank=True,
            )
            self._failure_seen = True
            self._stop_all()
            return
        failed = any(w.failure is not None for w in self.workers)
        if not failed or self.lost is not None:
            return
        now = time.monotonic()
        if self._failed_at is None:
            self._failed_at = now
        # The failed rank itself is finishing (its Idle, or its post-mortem) on its own.
        running = [w for w in self.workers if not w.finished and w.failure is None]
        since = now - self._failed_at
        if running and FAILURE_GRACE <= since < FAILURE_GRACE + INTERRUPT_GRACE:
            self._interrupt(running)
        elif running and since >= FAILURE_GRACE + INTERRUPT_GRACE:
            ranks = ", ".join(str(w.outcome.rank) for w in running)
            self._give_up(
                f"Rank{_plural(len(running))} {ranks} could not be stopped (blocked where an "
                "interrupt does not reach, most likely a collective the failed rank never "
                "joined), so every rank was stopped: the session was restarted with fresh "
                "ranks and every rank's state was lost."
            )

    def _answer_debuggers(self) -> None:
        began = time.monotonic()
        super()._answer_debuggers()
        if self._in_task and self._failed_at is not None:
            self._failed_at += time.monotonic() - began  # a post-mortem is not a hang

    def _interrupt(self, running: list[Rank]) -> None:
        """SIGINT the ranks, again every :data:`REPEAT_INTERRUPT` s while they run: a rank
        that had not yet entered its task when the first one came ignored it."""
        now = time.monotonic()
        if self._interrupted and now - self._last_interrupt < REPEAT_INTERRUPT:
            return
        self._interrupted, self._last_interrupt = True, now
        for worker in running:
            if worker.prompt is not None:
                # At a pdb prompt the rank waits for a line, not a signal: quit its debugger
                # (a breakpoint's function raises BdbQuit; a post-mortem ends).
                worker.prompt, worker.debugging = None, False
                worker.send(_protocol.DebugInput("q"))
            elif worker.process is not None and not worker.debugging:
                worker.process.send_signal(signal.SIGINT)

    def _give_up(self, reason: str) -> None:
        self.lost = Lost(reason, dead_rank=False)
        self._failure_seen = True
        self._stop_all()

    def _settle_interrupted(self) -> list[Rank]:
        """Interrupt the running ranks and wait for them; those that did not stop."""
        return self._settle([w for w in self.workers if not w.finished and w.alive])

    def _settle(self, running: list[Rank]) -> list[Rank]:
        """Interrupt ``running`` and wait until each is idle again; those that are not."""
        self._interrupted = False  # the first interrupt goes now
        self._interrupt(running)
        deadline = time.monotonic() + INTERRUPT_GRACE

        def idle(worker: Rank) -> bool:
            return worker.idle_task == worker.tasks_sent or not worker.alive

        while not all(idle(w) for w in running) and time.monotonic() < deadline:
            self._pump(0.02)
            self._poll_processes()
            self._interrupt([w for w in running if not idle(w)])
        return [w for w in running if not idle(w)]

    def _interrupted_error(self) -> KeyboardInterrupt:
        try:
            stuck = self._settle_interrupted()
        except KeyboardInterrupt:  # a second interrupt: no more waiting
            stuck = [w for w in self.workers if not w.finished]
        ranks = ", ".join(str(w.outcome.rank) for w in self.workers)
        if stuck:
            names = ", ".join(str(w.outcome.rank) for w in stuck)
            self._give_up(
                f"rank {names} did not stop (blocked in native code, e.g. a collective), so "
                "every rank was stopped: the session was restarted with fresh ranks and "
                "every rank's state was lost"
            )
            text = f"the cell was interrupted; {self.lost.reason if self.lost else ''}"
        else:
            text = (
                f"the cell was interrupted on rank {ranks}; the session is still usable "
                "(every rank is idle, with its state)"
            )
        return LaunchInterrupted(text)

    def _task_timeout(self, timeout: float) -> LaunchTimeoutError:
        live = [w for w in self.workers if w.alive and not w.finished]
        frames = self._stacks(live)
        text, stacks = _diagnosis.timeout_report(timeout, self._stuck_views(live, frames), "cell")
        stuck = self._settle_interrupted()
        if stuck:
            names = ", ".join(str(w.outcome.rank) for w in stuck)
            self._give_up(
                f"Rank {names} did not stop when interrupted, so every rank was stopped: the "
                "session was restarted with fresh ranks and every rank's state was lost."
            )
        text += "\n\n" + self._note()
        outcomes = [w.outcome for w in self.workers]
        error = LaunchTimeoutError(text, timeout, stacks, outcomes, self._logs())
        return self._with_reports(error)


def _plural(count: int) -> str:
    return "s" if count > 1 else ""
