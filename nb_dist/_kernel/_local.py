"""The local transport: a launch's ranks on this machine (``_transport.py``'s default).

Runs in the kernel. :meth:`LocalTransport.decide` is ``_plan.decide`` (this machine's
devices, the threads fork can give, the function shipped for spawn and forkserver);
:meth:`LocalTransport.open` opens the kernel's store, scratch folder and environments
(``_attempt.AttemptSetup``) for one attempt or one start of live ranks, and gives them to a
:class:`LocalHost`, which starts the ranks with ``_start.start_all`` and frees all of it
when the run (or the session) is over.
"""

from __future__ import annotations

from multiprocessing.connection import Connection

from .._rank._spec import RankSpec
from . import _openmp, _plan, _ports, _start, _warm
from ._attempt import AttemptSetup
from ._options import LaunchOptions
from ._plan import LaunchPlan
from ._supervisor import Supervisor


class LocalHost:
    """The supervisor's ``RankHost`` for ranks on this machine (fork, spawn or forkserver):
    it owns what the ranks share (``setup``: the store, the folder), closed with it."""

    def __init__(self, setup: AttemptSetup, restart: bool) -> None:
        self._setup: AttemptSetup | None = setup
        self._restart = restart
        self._supervisor: Supervisor | None = None

    def start(self, supervisor: Supervisor) -> Connection | None:
        plan = supervisor.config
        self._supervisor = supervisor
        if plan.start_method == "fork" and self._restart:
            _openmp.release_pool()  # a restart forks again, and the kernel may have a pool again

        def spec_for(index: int, kernel_fds: list[int]) -> RankSpec:
            return plan.rank_spec(index, supervisor.rank_envs[index], kernel_fds)

        lifeline = _start.start_all(plan.start_method, supervisor.ranks, spec_for)
        # Who may hold a port later: a busy port held by one of these is named as ours.
        pids = (w.outcome.pid for w in supervisor.ranks if w.outcome.pid)
        _ports.started_rank_pids.update(pids)
        return lifeline

    def close(self) -> None:
        # The ranks are reaped and their pipes closed by the supervisor.
        if self._setup is not None:
            self._setup.close()
            self._setup = None
        supervisor, self._supervisor = self._supervisor, None
        if supervisor is not None and supervisor.config.warm_imports:
            _warm.schedule(supervisor.imports)  # what the ranks imported, for the next launch

    def endpoints(self) -> list[tuple[str, int]] | None:
        return None  # read on this machine by the kernel itself


class LocalTransport:
    """Ranks on this machine: the :class:`~_transport.Transport` of every launch without
    ``cluster=``."""

    def decide(self, plan: LaunchPlan, options: LaunchOptions) -> LaunchPlan:
        return _plan.decide(plan, options)

    def open(self, plan: LaunchPlan, number: int) -> tuple[list[dict[str, str]], LocalHost]:
        setup = AttemptSetup(plan, number, "nb_dist_ranks_" if plan.session else "nb_dist_run_")
        return setup.envs, LocalHost(setup, restart=number > 0)

    def interrupted(self) -> None:
        pass  # the ranks are stopped; the fork server and warm imports stay as they are
