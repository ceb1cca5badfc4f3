"""The kernel side of live ranks: the supervisor's ranks kept alive across tasks.

A :class:`SessionSupervisor` holds a launch's :class:`~_supervisor.Supervisor`, its
``loop``, whose ranks serve tasks (``_serve.py``) instead of running one function and
exiting. The loop starts the ranks and does the ``select`` loop, output routing, stacks,
watchdogs and teardown; the session sees it only through :class:`TaskLoop`, the members it
uses, and builds its own errors from ``_run_errors``' pieces. It gives the loop a fresh
:class:`~_pump.Run` for each task, with that task's :class:`~_pump.Policy` (the part that
differs). What the session adds is the life of one task:

- before a task: every rank alive and idle, and their collective counts in step (a notice
  if not: the next collective may pair different calls and hang);
- a task ends when every rank it ran on sent :class:`~_protocol.Idle`;
- a failure: the other ranks get ``FAILURE_GRACE`` to end on their own, then an
  interrupt (SIGINT → ``KeyboardInterrupt`` in the task), then ``INTERRUPT_GRACE``
  (``_kernel/_watchdogs.py``); a rank still running then is blocked where no interrupt
  reaches it (a collective the failed rank never joined);
- a skipped collective proved by the counts (``_diagnosis.skipped_collective``), a timeout
  or the notebook's interrupt: the same verdict, without waiting;
- a blocked rank is freed, not killed (``_release``, ``_rank/_regroup.py``): the idle ranks
  shut their connections, its collective fails, and every rank forms the default group
  again, keeping its namespace. Only where that fails is every rank stopped and the session
  *lost*: its owner restarts it;
- a rank that dies (a signal, ``os._exit``): the process group cannot survive it, so every
  rank is stopped and the session is lost.
"""

from __future__ import annotations

import logging
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from .._kernel import _diagnosis, _run_errors, _watchdogs
from .._kernel._attempt_setup import Place
from .._kernel._errors import LaunchInterrupted, LaunchTimeoutError, RankStatus, WorkerFailedError
from .._kernel._observer import Observer
from .._kernel._output import OutputRouter
from .._kernel._plan import LaunchPlan
from .._kernel._pump import Policy, Run
from .._kernel._rank_handle import Rank, kill_all
from .._kernel._supervisor import RankHost, RunResult, Supervisor
from .._rank import _regroup
from .._shared import _collectives, _protocol, _shipping
from .._starter._processes import signal_name

_log = logging.getLogger(__name__)
#: How long closed ranks get to destroy their process group and exit.
CLOSE_GRACE = 1.0
#: How long ranks blocked in a collective get to leave it once the idle ranks dropped their
#: connections, and how long every rank gets to form the default group again.
RELEASE_LIMIT = 5.0
REGROUP_LIMIT = 20.0
#: What a message says when blocked ranks were freed and the state kept.
KEPT = (
    "Every rank kept its variables: the idle ranks closed their connections, so the blocked "
    "collective failed, and every rank formed the default process group again. Build again "
    "what was bound to the old group: a DistributedDataParallel model "
    "(model = DDP(model.module)) and subgroups from new_group; tensors, models, optimizers "
    "and samplers are as they were."
)


#: How the straggler notice of a cell says to put a limit on it.
LIMIT_HINT = "give the cell a limit (%%ranks --timeout 30, or timeout=... on exec/run)"

#: Starting the ranks and between tasks: a failure stops every rank (as in a launch), and a
#: failed rank's debugger is answered in the cell (there is no later ``%debug`` for it).
_BETWEEN = Policy(answers_post_mortems=True)


class TaskLoop(Protocol):
    """What the session uses of its supervisor loop (``_supervisor.Supervisor``), and no more:
    the ranks and the run going on, beginning a run, starting and watching, reading, the
    status change, stopping, the ranks' stacks and counters, the run's result, closing."""

    @property
    def ranks(self) -> list[Rank]:
        """Every rank, in index order."""
        ...

    @property
    def current(self) -> Run:
        """The run now going on (a task's, or the time between tasks)."""
        ...

    def begin_run(self, run: Run) -> None:
        """Go on with a fresh ``run`` (a task's, or the time between tasks)."""
        ...

    def start_and_watch(self) -> None:
        """Start every rank and read them until the run ends (the ranks' start)."""
        ...

    def watch(self, deadline: float | None) -> bool:
        """The loop and its watchdogs until the run's ranks have ended; whether ``deadline``
        passed first."""
        ...

    def read(self, wait: float) -> None:
        """Read the ranks' pipes for up to ``wait`` s."""
        ...

    def read_until(
        self, done: Callable[[], bool], seconds: float, each: Callable[[], None] | None = None
    ) -> bool:
        """Read and notice ended ranks until ``done()`` or ``seconds`` pass; whether done."""
        ...

    def poll_processes(self) -> None:
        """Notice the run's ranks that ended."""
        ...

    def set_status(self, rank: Rank, status: RankStatus) -> None:
        """The one place a rank's status changes."""
        ...

    def stop_for_failure(self) -> None:
        """Stop every rank of the run; no other failure of it is handled."""
        ...

    def stacks(self, ranks: list[Rank]) -> _run_errors.Stacks:
        """The live ``ranks``' Python stacks, by index."""
        ...

    def counter_file(self, rank: Rank) -> str | None:
        """The rank's collective counter file, if it has one."""
        ...

    def result(self) -> RunResult:
        """The run's values, or raise its root cause."""
        ...

    def close(self) -> None:
        """Stop reading, close the kernel's pipe ends, the lifeline and the host."""
        ...


@dataclass(frozen=True)
class Lost:
    """Why a session's ranks had to be stopped (its state is gone)."""

    reason: str  # a sentence for the user
    dead_rank: bool  # a rank died by itself (restart() by hand) vs. was stopped


@dataclass
class _TaskMarks:
    """What the current task (or the time between tasks) has noticed that only live ranks
    act on; fresh with each run the session begins."""

    interrupted: bool = False
    last_interrupt: float = 0.0
    #: The running ranks' counts when a skipped collective was first seen, and since when
    #: they have not changed.
    deadlock_key: tuple[tuple[int, int], ...] | None = None
    deadlock_since: float | None = None
    #: When a rank of the task failed, on the task's clock: time at a debugger's prompt
    #: (``Run.paused_for``) does not count.
    failed_at: float | None = None


class SessionSupervisor:
    """Ranks that stay up between tasks; ``start()``, then ``task()`` many times, ``close()``.

    It holds a :class:`~_supervisor.Supervisor`, its ``loop``, which starts, reads, watches
    and stops the ranks; the session decides what a task is. Each task is a fresh
    :class:`~_pump.Run` over the ranks it runs on, with the task's :class:`~_pump.Policy`:
    nothing a task collected or noticed is left for the next one.
    """

    def __init__(
        self,
        plan: LaunchPlan,
        envs: list[dict[str, str]],
        places: list[Place],
        router: OutputRouter,
        host: RankHost,
    ) -> None:
        #: The supervisor loop that starts, reads, watches and stops the ranks; between
        #: tasks (and while they start) its run watches every rank under ``_BETWEEN``.
        self.loop: TaskLoop = Supervisor(plan, envs, places, router, None, host, policy=_BETWEEN)
        #: What the ranks were planned as: whether a blocked rank can be freed in place
        #: depends on its debugging and backend (``_release``).
        self._plan = plan
        #: Where the ranks run: it reads their socket addresses on a cluster.
        self._host = host
        self.task_count = 0
        self._marks = _TaskMarks()
        #: Why the ranks were stopped, once they were (the session's state is gone).
        self.lost: Lost | None = None
        self._closed = False
        #: What the current task's message says about ranks freed after a failure.
        self._freed = ""
        #: How many times the default group was formed again (``_release``): its store prefix.
        self._generation = 0
        #: Reports accumulate over the session's tasks (``result.reports`` holds them all).
        self._reports = self.current.reports

    # ----------------------------------------------------------------- life
    def start(self) -> None:
        """Start every rank and wait until each has its process group (or raise)."""
        __tracebackhide__ = True
        try:
            self.loop.start_and_watch()
            self.loop.result()  # raises if a rank could not start
            self.current.router.finish()
        except BaseException:
            self.close()
            raise

    def _begin(
        self,
        ranks: list[Rank],
        router: OutputRouter,
        policy: Policy,
        observer: Observer | None = None,
    ) -> None:
        """A fresh run of the loop (and fresh marks) over ``ranks``; the reports carry on."""
        self.loop.begin_run(Run(ranks, router, observer, self._reports, policy))
        self._marks = _TaskMarks()

    def close(self) -> None:
        """Let every rank leave (its process group destroyed), kill what does not, reap."""
        if self._closed:
            return
        self._closed = True
        for rank in self.ranks:
            if rank.commands is not None and not rank.commands.closed:
                rank.commands.close()  # EOF: the rank's loop ends
        self._begin(self.ranks, self.current.router, _BETWEEN)
        self.loop.read_until(lambda: not any(rank.alive for rank in self.ranks), CLOSE_GRACE)
        kill_all(self.ranks)
        self.loop.close()

    @property
    def current(self) -> Run:
        """The loop's run now going on: a task's, or the time between tasks (``_begin``)."""
        return self.loop.current

    @property
    def ranks(self) -> list[Rank]:
        """Every rank of the session (its loop's), in index order."""
        return self.loop.ranks

    @property
    def alive(self) -> bool:
        return self.lost is None and all(rank.alive for rank in self.ranks)

    # ----------------------------------------------------------------- one task
    def check_ready(self) -> str | None:
        """Before a task: ``None``, or a notice that the ranks' collective counts differ."""
        self.loop.poll_processes()
        dead = [rank for rank in self.ranks if not rank.alive]
        if dead:
            code = dead[0].returncode
            name = signal_name(-code) if code is not None and code < 0 else None
            how = _diagnosis.ended_without_value(code, name)
            self.lost = Lost(f"rank {dead[0].outcome.rank} ended between cells: {how}", True)
            self.close()
            return None
        busy = [rank for rank in self.ranks if not _idle(rank)]
        if busy:  # a cell left running (a second interrupt cut its ending short)
            stuck = self._settle(busy)
            if stuck:
                names = ", ".join(str(rank.outcome.rank) for rank in stuck)
                self.lost = Lost(
                    f"rank {names} was still busy with an earlier cell and could not be "
                    "interrupted", dead_rank=False,
                )  # fmt: skip
                self.close()
                return None
        counts = {rank.outcome.rank: rank.collectives for rank in self.ranks}
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
        indexes: list[int],
        router: OutputRouter,
        observer: Observer | None,
        timeout: float | None,
    ) -> RunResult:
        """Run one task on the ranks at ``indexes``: their values, or a launch error (see the
        module)."""
        __tracebackhide__ = True
        policy = Policy(
            answers_post_mortems=True,
            limit_hint=LIMIT_HINT,
            on_failure=self._on_task_failure,
            closing_note=self._note,
            watch=self._check_skipped_collective,
        )
        self._begin([self.ranks[i] for i in indexes], router, policy, observer)
        self.task_count += 1
        self._freed = ""
        try:
            for rank in self.current.ranks:
                rank.begin_task()
                self.loop.set_status(rank, "running")
                rank.task_sent(command_for(rank))
            deadline = None if timeout is None else time.monotonic() + timeout
            try:
                timed_out = self.loop.watch(deadline)
            except KeyboardInterrupt:
                raise self._interrupted_error() from None
            if timed_out:
                raise self._task_timeout(timeout or 0.0)
            self.loop.read(0.0)  # output written just before the last Idle
            for rank in self.current.ranks:
                for kind, splitter in rank.splitters.items():
                    router.lines(rank.index, kind, splitter.flush())
            return self.loop.result()
        finally:
            # Between tasks the session watches every rank, and nobody observes it.
            self._begin(self.ranks, router, _BETWEEN)
            router.finish()
            if self.lost is not None:
                self.close()

    def _note(self) -> str:
        if self.lost is None:
            usable = "The session is still usable: every rank is idle, with its state."
            return f"{self._freed}\n{usable}" if self._freed else usable
        return self.lost.reason

    # ----------------------------------------------------------------- failures
    def _on_task_failure(self) -> None:
        """A task's policy: a dead rank ends the session; a failed one gets the others
        interrupted, and a rank no interrupt reaches ends the session."""
        dead = [rank for rank in self.current.ranks if not rank.alive and not rank.stop_requested]
        if dead and self.lost is None:
            who = dead[0]
            self.lost = Lost(
                f"Rank {who.outcome.rank} died, so its process group cannot go on: every "
                "rank was stopped and their state is lost. Call restart() for fresh ranks.",
                dead_rank=True,
            )
            self.loop.stop_for_failure()
            return
        failed = any(rank.failure is not None for rank in self.current.ranks)
        if not failed or self.lost is not None:
            return
        now = time.monotonic() - self.current.paused_for  # the task's clock
        if self._marks.failed_at is None:
            self._marks.failed_at = now
        # The failed rank itself is finishing (its Idle, or its post-mortem) on its own.
        in_task = self.current.ranks
        running = [rank for rank in in_task if not rank.finished and rank.failure is None]
        phase = _watchdogs.after_failure(self._marks.failed_at, now)
        if running and phase == "interrupt":
            self._interrupt(running)
        elif running and phase == "give up":
            numbers = ", ".join(str(rank.outcome.rank) for rank in running)
            ranks = f"Rank{_plural(len(running))} {numbers}"
            self._free_or_stop(
                running,
                f"{ranks} could not be interrupted (blocked in a collective the failed rank "
                "never joined).",
                f"{ranks} could not be stopped (blocked where an interrupt does not reach, most "
                "likely a collective the failed rank never joined), so every rank was stopped: "
                "the session was restarted with fresh ranks and every rank's state was lost.",
            )

    # ----------------------------------------------------------------- freeing blocked ranks
    def _release(self, stuck: list[Rank]) -> bool:
        """Free ``stuck`` ranks, blocked in a collective, without killing them
        (``_rank/_regroup.py``): idle ranks drop their connections to the others until every
        stuck rank has ended its cell, then every rank forms the default group again.
        Whether that worked (every rank idle, with a fresh group, its namespace kept)."""
        if self._plan.debug is not None or not stuck or self.lost is not None:
            return False  # a post-mortem would open on the freed rank's connection error
        if self._plan.backend != "gloo":
            # NCCL's collectives wait on the GPU, not on a socket the idle ranks could shut;
            # torch's abort would have to run inside the blocked rank. Stopped, as before.
            return False
        # The calls below are not the cell's work: its live view (which knows only the cell's
        # ranks) does not hear of them; it is closed with the cell's error.
        self.current.observer = None
        try:
            peers = self._rank_endpoints()
        except Exception:  # an agent that cannot read them: stopped, as when nothing frees
            _log.info("nb_dist: reading the ranks' socket addresses failed", exc_info=True)
            return False
        dropped: set[int] = set()
        deadline = time.monotonic() + RELEASE_LIMIT
        while True:
            if not all(rank.alive for rank in self.ranks):
                return False
            waiting = [rank for rank in self.ranks if not _idle(rank)]
            if not waiting:
                break
            fresh = [rank for rank in self.ranks if _idle(rank) and rank.index not in dropped]
            if not fresh or time.monotonic() >= deadline:
                return False
            dropped.update(rank.index for rank in fresh)
            if self._call(fresh, _regroup.drop_connections, peers, limit=2.0):
                return False
            self.loop.read_until(
                lambda waiting=waiting: all(_idle(rank) for rank in waiting),  # type: ignore[misc]
                max(0.0, deadline - time.monotonic()),
            )
        self._generation += 1
        failed = self._call(
            list(self.ranks), _regroup.regroup, self._generation, REGROUP_LIMIT,
            limit=REGROUP_LIMIT + 5.0,
        )  # fmt: skip
        return not failed and all(rank.alive for rank in self.ranks)

    def _rank_endpoints(self) -> list[tuple[str, int]]:
        """Every rank's TCP socket addresses: read where the ranks run (on a cluster, by each
        node's agent), else here."""
        found = self._host.endpoints()
        if found is not None:
            return found
        pids = [rank.process.pid for rank in self.ranks if rank.process is not None]
        return _regroup.endpoints(pids)

    def _free_or_stop(self, stuck: list[Rank], freed: str, lost: str) -> bool:
        """Free ``stuck`` ranks (:meth:`_release`), the cell's closing note saying so
        (``freed``, then what was kept); else stop every rank, the session lost (``lost``).
        Whether they were freed."""
        try:
            released = self._release(stuck)
        except KeyboardInterrupt:  # a second ■: no more waiting
            released = False
        if released:
            self._freed = f"{freed} {KEPT}".strip()
        else:
            self._give_up(lost)
        return released

    def _call(self, ranks: list[Rank], function: Callable[..., object], *args: object,
              limit: float) -> list[Rank]:  # fmt: skip
        """Run ``function(*args)`` on the idle ``ranks``, outside any cell; those where it
        did not end well within ``limit`` s."""
        payload = _shipping.dumps((function, args, {}))
        failures = {rank.index: rank.failure for rank in ranks}
        for rank in ranks:
            rank.task_sent(_protocol.Call(0, payload))
        self.loop.read_until(lambda: all(_idle(rank) for rank in ranks), limit)
        return [
            rank for rank in ranks if not _idle(rank) or rank.failure is not failures[rank.index]
        ]

    def _check_skipped_collective(self) -> None:
        """End the cell when the counts prove a deadlock (``_diagnosis.skipped_collective``)
        that has looked the same for ``DEADLOCK_SETTLE`` s: no rank can leave it."""
        run = self.current
        if self.lost is not None or run.failure_seen or self._marks.failed_at is not None:
            return
        if any(rank.failure is not None for rank in run.ranks):
            return  # a failure's own path interrupts the others
        in_task = {rank.index for rank in run.ranks}
        running = [rank for rank in run.ranks if not rank.finished and rank.alive]
        done = [rank for rank in run.ranks if rank.finished and rank.outcome.status == "ok"]
        done += [rank for rank in self.ranks if rank.index not in in_task and rank.alive]
        now = time.monotonic()
        if not running or not done:
            self._marks.deadlock_key = self._marks.deadlock_since = None
            return
        states = {
            rank.outcome.rank: _collectives.read(self.loop.counter_file(rank) or "")
            for rank in running
        }
        found = _diagnosis.skipped_collective(
            {rank.outcome.rank: rank.collectives for rank in done}, states
        )
        key = None
        if found is not None:
            key = tuple((rank, state.entered) for rank, state in found.blocked)
        marks = self._marks
        if key != marks.deadlock_key:
            marks.deadlock_key, marks.deadlock_since = key, now if key is not None else None
            return
        if found is None or not _watchdogs.deadlock_due(marks.deadlock_since, now):
            return
        frames = self.loop.stacks(running)
        by_rank = {rank.outcome.rank: frames.get(rank.index, []) for rank in running}
        text = _diagnosis.skipped_collective_report(found, by_rank)
        root = running[0]
        self._free_or_stop(
            running,
            "",
            "The blocked ranks could not be freed, so every rank was stopped: the session was "
            "restarted with fresh ranks and every rank's state was lost.",
        )
        root.blame("SkippedCollective", text.split("\n", 1)[0])
        outcomes = [rank.outcome for rank in run.ranks]
        message = f"{text}\n\n{self._note()}"
        raise _run_errors.with_reports(
            WorkerFailedError(message, root.outcome, outcomes, _run_errors.logs(run)), run
        )

    def _interrupt(self, running: list[Rank]) -> None:
        """SIGINT the ranks, again every ``REPEAT_INTERRUPT`` s while they run: a rank that
        had not yet entered its task when the first one came ignored it."""
        now = time.monotonic()
        marks = self._marks
        if not _watchdogs.interrupt_due(marks.interrupted, marks.last_interrupt, now):
            return
        marks.interrupted, marks.last_interrupt = True, now
        for rank in running:
            if rank.prompt is not None:
                # At a pdb prompt the rank waits for a line, not a signal: quit its debugger
                # (a breakpoint's function raises BdbQuit; a post-mortem ends).
                rank.quit_debugger()
            elif rank.process is not None and not rank.debugging:
                rank.process.send_signal(signal.SIGINT)

    def _give_up(self, reason: str) -> None:
        self.lost = Lost(reason, dead_rank=False)
        self.loop.stop_for_failure()

    def _settle_interrupted(self) -> list[Rank]:
        """Interrupt the running ranks and wait for them; those that did not stop."""
        in_task = self.current.ranks
        return self._settle([rank for rank in in_task if not rank.finished and rank.alive])

    def _settle(self, running: list[Rank]) -> list[Rank]:
        """Interrupt ``running`` and wait until each is idle again; those that are not."""
        self._marks.interrupted = False  # the first interrupt goes now
        self._interrupt(running)
        self.loop.read_until(
            lambda: all(_idle(rank) for rank in running),
            _watchdogs.INTERRUPT_GRACE,
            each=lambda: self._interrupt([rank for rank in running if not _idle(rank)]),
        )
        return [rank for rank in running if not _idle(rank)]

    def _interrupted_error(self) -> KeyboardInterrupt:
        try:
            stuck = self._settle_interrupted()
        except KeyboardInterrupt:  # a second interrupt: no more waiting
            stuck = [rank for rank in self.current.ranks if not rank.finished]
        ranks = ", ".join(str(rank.outcome.rank) for rank in self.current.ranks)
        if stuck:
            names = ", ".join(str(rank.outcome.rank) for rank in stuck)
            self._free_or_stop(
                stuck,
                f"rank {names} did not stop (blocked in native code, e.g. a collective) and "
                "was freed.",
                f"rank {names} did not stop (blocked in native code, e.g. a collective), so "
                "every rank was stopped: the session was restarted with fresh ranks and "
                "every rank's state was lost",
            )
            text = f"the cell was interrupted; {self._note()}"
        else:
            text = (
                f"the cell was interrupted on rank {ranks}; the session is still usable "
                "(every rank is idle, with its state)"
            )
        return LaunchInterrupted(text)

    def _task_timeout(self, timeout: float) -> LaunchTimeoutError:
        live = [rank for rank in self.current.ranks if rank.alive and not rank.finished]
        frames = self.loop.stacks(live)
        views = _run_errors.stuck_views(self.current, live, frames, self.loop.counter_file)
        text, stacks = _diagnosis.timeout_report(timeout, views, "cell")
        stuck = self._settle_interrupted()
        if stuck:
            names = ", ".join(str(rank.outcome.rank) for rank in stuck)
            self._free_or_stop(
                stuck,
                f"Rank {names} did not stop when interrupted and was freed.",
                f"Rank {names} did not stop when interrupted, so every rank was stopped: the "
                "session was restarted with fresh ranks and every rank's state was lost.",
            )
        text += "\n\n" + self._note()
        outcomes = [rank.outcome for rank in self.current.ranks]
        error = LaunchTimeoutError(text, timeout, stacks, outcomes, _run_errors.logs(self.current))
        return _run_errors.with_reports(error, self.current)


def _idle(rank: Rank) -> bool:
    """Whether ``rank`` has finished every command it was sent (alive or not)."""
    return rank.idle_task == rank.tasks_sent or not rank.alive


def _plural(count: int) -> str:
    return "s" if count > 1 else ""
