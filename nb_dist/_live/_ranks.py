"""``nb_dist.Ranks``: N ranks that stay up across cells, each with its own namespace.

Where a launch is one function, start to finish, a :class:`Ranks` session keeps its
ranks (and their process group) alive, so a walkthrough can go one step per cell: build
the model on every rank, look at each rank's gradients, all-reduce, look again. The ranks
are the launcher's ranks, started and watched by the same pieces (``_transport.prepare``
plans them, the transport opens them, the supervisor's loop, ``_diagnosis``), serving
tasks (``_serve.py``) under a :class:`~_session.SessionSupervisor`; every cell inherits the
launcher's contract: labelled output in the cell, root causes, timeouts with stacks,
interrupts, no orphans.
"""

from __future__ import annotations

import atexit
import itertools
import linecache
import os
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any

from .._kernel import _leftovers, _prompts, _warm
from .._kernel._arguments import LaunchOptions
from .._kernel._errors import LaunchError
from .._kernel._observer import open_live_view
from .._kernel._output import OutputRouter
from .._kernel._plan import LaunchPlan
from .._kernel._result import LaunchResult
from .._kernel._transport import Transport, open_supervised, prepare
from .._shared import _protocol, _shipping
from .._shared._protocol import RESERVED
from . import _export
from ._per_rank import PerRank
from ._session import SessionSupervisor


class SessionError(LaunchError):
    """A live-ranks session cannot run this: it is closed, or its ranks were lost."""


UNSET: Any = object()


def _idle() -> None:
    """What a session's plan names as its function: the ranks serve tasks instead."""


class Ranks:
    """N live ranks, started now, each with the process group initialized.

    ``ranks.run(fn, *args)`` runs a function on every rank, ``ranks.exec(source)`` runs code
    in each rank's namespace (what a ``%%ranks`` cell does), ``ranks.pull(name)`` brings a
    value back from every rank, ``ranks.push(name=value)`` sends one. Each returns a
    :class:`~nb_dist.LaunchResult`, one value per rank. The ranks start as copies of the
    kernel (fork): what the notebook defined before the start is there.

    A failure in a cell ends the cell with the root cause, as a launch does; the session
    stays usable when every rank is idle afterwards. A rank blocked in a collective that
    others skipped (detected from the collective counts, or after a failure, a timeout or ■)
    is freed by the idle ranks closing their connections, and every rank forms the default
    process group again, keeping its variables. Where that fails, or a rank died, every rank
    is stopped: a blocked session restarts by itself (saying that state was lost), a dead
    rank's session needs :meth:`restart`. Close it with :meth:`close` or
    ``with Ranks(2) as ranks:``; the kernel closes open sessions when it shuts down, and
    ranks die with the kernel.

    Args:
        num_processes: how many ranks (``None``: one per visible GPU on this machine; with
            ``cluster=``, the ranks on all its nodes).
        mixed_precision, device, threads_per_process, output, rich_output, start_method,
        use_port, master_addr, rendezvous_timeout, log_line_prefix_template: as for
            :func:`~nb_dist.notebook_launcher`. ``start_method="spawn"`` ranks start from an
            empty namespace instead of the kernel's.
        timeout: default seconds for each cell (``None``: no limit); past it, the cell shows
            every rank's stack and stops.
        hang_notice_after: when some ranks finished the cell and another still runs this many
            seconds later, print which rank, for how long and where it is, and keep waiting
            (■ still ends the cell). ``None``: never.
        monitor: show the live per-rank dashboard in each cell.
        debug: ``"postmortem"``: a rank that fails opens pdb at its exception, in the
            failing cell, driven from the notebook.
        cluster: the ranks on a cluster's nodes (``nb_dist.RayCluster(...)``), each cell's
            output, values and errors as on this machine; a rank blocked in a collective
            is freed in place there too (each node's agent reads its ranks' sockets).
    """

    def __init__(
        self,
        num_processes: int | None = None,
        *,
        mixed_precision: str = "no",
        device: str = "auto",
        threads_per_process: int | None = None,
        output: str = "all",
        rich_output: str | int | Sequence[int] = "rank0",
        start_method: str = "fork",
        timeout: float | None = None,
        hang_notice_after: float | None = 10.0,
        monitor: bool = False,
        use_port: int | str | None = None,
        master_addr: str = "127.0.0.1",
        rendezvous_timeout: float | str | None = "auto",
        log_line_prefix_template: str | None = None,
        debug: str | None = None,
        cluster: Transport | None = None,
    ) -> None:
        __tracebackhide__ = True
        _warm.wait()  # the checks read the kernel's state (as notebook_launcher's do)
        _leftovers.stop_all()  # sessions nobody holds any more end here, in this cell
        # A launch's options where they apply; the rest are what live ranks always are (one
        # machine, a static rendezvous, no restarts, a process group, no warm imports).
        self._options = LaunchOptions(
            num_processes=num_processes, mixed_precision=mixed_precision, use_port=use_port,
            master_addr=master_addr, log_line_prefix_template=log_line_prefix_template,
            start_method=start_method, timeout=timeout, output=output, init_process_group=True,
            hang_notice_after=hang_notice_after,
            device=device, threads_per_process=threads_per_process, monitor=monitor,
            rendezvous_timeout=rendezvous_timeout, warm_imports=False, rich_output=rich_output,
            debug=debug,
        )  # fmt: skip
        self._cluster = cluster  # this machine (None), or cluster='s nodes
        # What runs (the ranks, the store): held apart from this object, so that a Ranks
        # dropped without close() is stopped at the next launch, not in a finalizer.
        self._held = _Held()
        self._finalizer = weakref.finalize(self, _leftovers.leave, self._held.stop)
        self._closed = False
        self._history = _export.History()
        self.restarts = 0
        self._cell_number = 0  # names the source of each exec() for tracebacks
        self._start()  # the arguments are checked here, before anything starts
        self._started_order = next(_order)
        _open_sessions.add(self)

    # ----------------------------------------------------------------- life
    def _start(self) -> None:
        __tracebackhide__ = True
        _prompts.release_all()
        self._transport, plan = prepare(_idle, (), self._options, self._cluster, session=True)
        self.plan: LaunchPlan = plan
        router = self._router()
        for text in plan.notices:
            router.notice(text)
        # Where the ranks run: their environments (the store opened) and the host that
        # starts them and, when the session closes, frees what open() opened.
        supervisor, self._port = open_supervised(
            self._transport, plan, self.restarts,
            lambda envs, places, host: SessionSupervisor(plan, envs, places, router, host),
        )  # fmt: skip
        supervisor.start()  # on failure it closes itself (its host too) and raises
        self._held.supervisor = supervisor
        self._history.started(plan)

    @staticmethod
    def pids_of(supervisor: SessionSupervisor) -> list[int]:
        return [rank.outcome.pid for rank in supervisor.ranks if rank.outcome.pid]

    def _router(self) -> OutputRouter:
        plan = self.plan
        return OutputRouter(list(plan.ranks), plan.output, plan.prefix, rich=plan.rich_output)

    def restart(self) -> None:
        """Stop every rank and start fresh ones (the kernel's namespace as it is now)."""
        __tracebackhide__ = True
        self._check_open()
        self._renew()

    def _renew(self) -> None:
        """Stop the ranks (if any still run) and start fresh ones."""
        self._stop()
        self.restarts += 1
        self._start()

    def close(self) -> None:
        """Stop every rank (each destroys its process group first). Safe to call twice."""
        if self._closed:
            return
        self._closed = True
        _open_sessions.discard(self)
        self._finalizer.detach()
        self._stop()

    def _stop(self) -> None:
        self._held.stop()

    def __enter__(self) -> Ranks:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def num_processes(self) -> int:
        return self.plan.nprocs

    @property
    def pids(self) -> list[int]:
        """The ranks' process ids (they change on a restart)."""
        return self.pids_of(self._held.supervisor) if self._held.supervisor is not None else []

    @property
    def cells(self) -> int:
        """How many tasks the current ranks have run."""
        return self._held.supervisor.task_count if self._held.supervisor is not None else 0

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"{self.num_processes} ranks, {self.cells} cells"
        return f"Ranks({state})"

    # ----------------------------------------------------------------- tasks
    def run(
        self, function: Callable[..., Any], /, *args: Any, timeout: float | None = UNSET,
        **kwargs: Any,
    ) -> LaunchResult:  # fmt: skip
        """Run ``function(*args, **kwargs)`` on every rank; each rank's return value.

        The function is shipped by value (cloudpickle), so one defined after the start works.
        It runs with the rank's namespace as its globals: names an earlier cell made on the
        rank (a model, an optimizer) are the rank's own; functions, classes and modules it
        uses come from the kernel. ``timeout`` is this call's limit (not passed on).
        """
        __tracebackhide__ = True
        if not callable(function):
            raise TypeError(f"run(function={function!r}): pass a function (or other callable).")
        try:
            payload = _shipping.dumps((function, args, kwargs))
        except Exception as exc:
            raise TypeError(
                f"run({_name(function)}, ...): the function or its arguments cannot be sent to "
                f"the ranks ({type(exc).__name__}: {exc}). Pass plain data (numbers, tensors, "
                "lists, dicts), or build the object on the ranks in a cell."
            ) from None
        result = self._task(lambda rank: _protocol.Call(0, payload), None, timeout)
        self._history.called(function, args, kwargs)
        return result

    def exec(
        self, source: str, *, rank: int | Sequence[int] | None = None,
        timeout: float | None = UNSET, filename: str | None = None,
    ) -> LaunchResult:  # fmt: skip
        """Run ``source`` in each rank's namespace (on ``rank`` only, if given); each rank's
        value of the last expression, as ``Out[n]`` would show it."""
        __tracebackhide__ = True
        if not isinstance(source, str):
            raise TypeError(f"exec(source={source!r}): pass the code as a string.")
        self._cell_number += 1
        name = filename or f"<ranks cell {self._cell_number}>"
        try:
            compile(source, name, "exec")
        except SyntaxError as exc:
            raise exc.with_traceback(None) from None  # shown once, not once per rank
        chosen = self._indexes(rank)
        if filename is None:  # the kernel shows this code in stacks and tracebacks too
            linecache.cache[name] = (len(source), None, source.splitlines(True), name)
        result = self._task(lambda r: _protocol.Execute(0, source, name), chosen, timeout)
        self._history.executed(source, [self.plan.ranks[i] for i in chosen], self.num_processes)
        return result

    def pull(self, *names: str, rank: int | Sequence[int] | None = None) -> LaunchResult:
        """Each rank's value of ``name`` (tensors as CPU copies); several names: tuples."""
        __tracebackhide__ = True
        if not names or not all(isinstance(n, str) and n.isidentifier() for n in names):
            raise TypeError(
                f"pull{names!r}: pass one or more variable names as strings, e.g. pull('loss')."
            )
        chosen = self._indexes(rank)
        return self._task(lambda r: _protocol.Pull(0, names), chosen, UNSET)

    def push(self, **values: Any) -> None:
        """Set names in every rank's namespace; ``per_rank(v0, v1, ...)`` for values that
        differ by rank (rank ``i`` gets ``v_i``)."""
        __tracebackhide__ = True
        if not values:
            raise TypeError("push() needs names and values, e.g. push(lr=0.1).")
        reserved = sorted(RESERVED & values.keys())
        if reserved:
            raise ValueError(
                f"push({reserved[0]}=...): {reserved[0]} belongs to the rank's namespace "
                "itself. Push your values under other names."
            )
        n = self.num_processes
        for name, value in values.items():
            if isinstance(value, PerRank) and len(value.values) != n:
                raise ValueError(
                    f"push({name}=per_rank(...)) got {len(value.values)} values for {n} ranks. "
                    f"Give exactly one value per rank."
                )
        payloads = []
        for index in range(n):
            mine = {k: v.values[index] if isinstance(v, PerRank) else v for k, v in values.items()}
            try:
                payloads.append(_shipping.dumps(mine))
            except Exception as exc:
                raise TypeError(
                    f"push(...): a value cannot be sent to the ranks ({type(exc).__name__}: "
                    f"{exc}). Push plain data (numbers, tensors, lists, dicts)."
                ) from None
        self._task(lambda rank: _protocol.Push(0, payloads[rank.index]), None, UNSET)
        self._history.pushed(values)

    def export(self, path: str | os.PathLike[str]) -> str:
        """Write this session's cells, in order, as a script for ``torchrun``; its path.

        Run it with ``torchrun --nproc-per-node N path``: the way from an interactive session
        to a cluster. Names the cells use that the kernel defined before the start are
        written too where they can be (imports, functions, classes, plain values).
        """
        text = self._history.script(self.plan, os.path.basename(os.fspath(path)))
        with open(path, "w", encoding="utf-8") as file:
            file.write(text)
        return os.fspath(path)

    # ----------------------------------------------------------------- internals
    def _check_open(self) -> None:
        if self._closed:
            raise SessionError(
                "This Ranks session is closed. Start a new one: ranks = nb_dist.Ranks(2)."
            )

    def _indexes(self, rank: int | Sequence[int] | None) -> list[int]:
        """The indexes of the ranks ``rank=`` names (all of them for ``None``), checked."""
        n = self.num_processes
        if rank is None:
            return list(range(n))
        chosen: Sequence[object] = [rank] if isinstance(rank, int) else rank
        if (
            isinstance(chosen, (str, bytes))
            or not chosen
            or not all(
                isinstance(r, int) and not isinstance(r, bool) and 0 <= r < n for r in chosen
            )
        ):
            raise ValueError(
                f"rank={rank!r}: give a rank between 0 and {n - 1}, or a list of them."
            )
        return sorted({int(r) for r in chosen})  # type: ignore[call-overload]

    def _live(self) -> SessionSupervisor:
        __tracebackhide__ = True
        self._check_open()
        supervisor = self._held.supervisor
        if supervisor is None or supervisor.lost is not None:
            raise _gone(supervisor.lost.reason if supervisor and supervisor.lost else "")
        notice = supervisor.check_ready()
        lost = supervisor.lost
        if lost is not None and not lost.dead_rank:
            # A rank that could not be stopped: fresh ranks, as after a blocked cell.
            self._router().notice(f"{lost.reason}: every rank was stopped and the session "
                                  "restarted with fresh ranks; their state was lost.")  # fmt: skip
            self._renew()
            return self._live()
        if lost is not None:
            raise _gone(lost.reason)
        if notice is not None:
            self._router().notice(notice)
        return supervisor

    def _task(
        self,
        command_for: Callable[[Any], _protocol.Command],
        indexes: list[int] | None,
        timeout: float | None,
    ) -> LaunchResult:
        __tracebackhide__ = True
        supervisor = self._live()
        began = time.monotonic()
        limit = self.plan.timeout if timeout is UNSET else timeout
        chosen = list(range(self.num_processes)) if indexes is None else indexes
        router = self._router()
        monitor = (
            open_live_view([self.plan.ranks[i] for i in chosen]) if self.plan.monitor else None
        )
        router.observer = monitor
        failure: BaseException | None = None
        try:
            outcome = supervisor.task(command_for, chosen, router, monitor, limit)
        except BaseException as error:
            failure = error
            if monitor is not None:
                monitor.close(getattr(error, "outcomes", None), interrupted=True)
        if failure is not None:
            lost = supervisor.lost
            if lost is not None and not lost.dead_rank:
                # A blocked session restarts by itself (the error says so). Outside the
                # except block: a rank forked there would chain the kernel's exception to
                # every exception it raises later.
                self._renew()
            raise failure
        if monitor is not None:
            monitor.close(outcome.outcomes)
        return LaunchResult(
            values=outcome.values,
            reports=outcome.reports,
            ranks=[self.plan.ranks[i] for i in chosen],
            outcomes=outcome.outcomes,
            logs=[router.log_text(i) for i in chosen],
            durations=outcome.durations,
            wall_time=time.monotonic() - began,
            port=self._port,
            start_method=self.plan.start_method,
        )


class _Held:
    """A session's running parts; :meth:`stop` ends them (``close()``, or the next launch
    after the ``Ranks`` object was dropped: ``_kernel/_leftovers.py``)."""

    def __init__(self) -> None:
        self.supervisor: SessionSupervisor | None = None

    def stop(self) -> None:
        if self.supervisor is not None:
            self.supervisor.close()  # and its host: the store, folder or agents it held
            self.supervisor = None


def _gone(reason: str) -> SessionError:
    """The error for a session whose ranks were stopped, with why and what to do."""
    reason = reason.rstrip(". ")
    advice = "" if "restart()" in reason else " Call restart() to start fresh ranks."
    return SessionError(f"This session's ranks are gone: {reason}.{advice}")


def _name(function: Any) -> str:
    return getattr(function, "__qualname__", None) or repr(function)


#: Open sessions, closed when the kernel shuts down; the newest is what ``%%ranks`` uses.
_open_sessions: weakref.WeakSet[Ranks] = weakref.WeakSet()
_order = itertools.count()


def current() -> Ranks | None:
    """The most recently started session that is still open."""
    live = [s for s in _open_sessions if not s.closed]
    if not live:
        return None
    return max(live, key=lambda s: s._started_order)


def _close_all() -> None:
    for session in list(_open_sessions):
        session.close()


atexit.register(_close_all)
