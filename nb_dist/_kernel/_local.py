"""The local transport: a launch's ranks on this machine (``_transport.py``'s default).

Runs in the kernel. :meth:`LocalTransport.decide` is ``_plan.decide`` (this machine's
devices, the threads fork can give, the function shipped for spawn and forkserver); an
attempt opens the kernel's store, scratch folder and environments (``_attempt.AttemptSetup``)
and runs the supervisor with a :class:`LocalHost`, which starts the ranks with
``_start.start_all``. Live ranks keep their ``AttemptSetup`` in their host until it closes.
"""

from __future__ import annotations

from multiprocessing.connection import Connection

from .._rank._spec import WorkerSpec
from . import _openmp, _plan, _ports, _start, _warm
from ._attempt import AttemptSetup
from ._observer import Observer
from ._options import LaunchOptions
from ._output import OutputRouter
from ._plan import LaunchPlan
from ._supervisor import AttemptResult, Supervisor


class LocalHost:
    """The supervisor's ``RankHost`` for ranks on this machine (fork, spawn or forkserver).

    ``setup``: what the ranks share (store, folder), closed with the host; a launch's
    attempt closes its own instead."""

    def __init__(self, setup: AttemptSetup | None = None) -> None:
        self._setup = setup

    def start(self, supervisor: Supervisor) -> Connection | None:
        plan = supervisor.config

        def spec_for(index: int, kernel_fds: list[int]) -> WorkerSpec:
            return plan.worker_spec(index, supervisor.worker_env[index], kernel_fds)

        lifeline = _start.start_all(plan.start_method, supervisor.workers, spec_for)
        # Who may hold a port later: a busy port held by one of these is named as ours.
        pids = (w.outcome.pid for w in supervisor.workers if w.outcome.pid)
        _ports.started_worker_pids.update(pids)
        return lifeline

    def close(self) -> None:
        # The ranks are reaped and their pipes closed by the supervisor.
        if self._setup is not None:
            self._setup.close()
            self._setup = None

    def endpoints(self) -> list[tuple[str, int]] | None:
        return None  # read on this machine by the kernel itself


class LocalTransport:
    """Ranks on this machine: the :class:`~_transport.Transport` of every launch without
    ``cluster=``."""

    def decide(self, plan: LaunchPlan, options: LaunchOptions) -> LaunchPlan:
        return _plan.decide(plan, options)

    def run_attempt(
        self, plan: LaunchPlan, number: int, router: OutputRouter, observer: Observer | None
    ) -> tuple[AttemptResult, int]:
        if plan.start_method == "fork" and number:
            _openmp.release_pool()  # a restart forks again, and the kernel may have a pool again
        with AttemptSetup(plan, number, "nb_dist_errors_") as opened:
            supervisor = Supervisor(plan, opened.envs, router, observer, LocalHost())
            try:
                return supervisor.run(), opened.port
            finally:
                router.finish()
                if plan.warm_imports:
                    _warm.schedule(supervisor.imports)

    def session_host(self, plan: LaunchPlan, number: int) -> tuple[list[dict[str, str]], LocalHost]:
        setup = AttemptSetup(plan, number, "nb_dist_ranks_")
        return setup.envs, LocalHost(setup)

    def interrupted(self) -> None:
        pass  # the ranks are stopped; the fork server and warm imports stay as they are
