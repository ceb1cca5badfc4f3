"""Live ranks on a cluster (``nb_dist.Ranks(cluster=...)``): runs in the kernel.

A :class:`ClusterSession` is the live ranks' ``SessionSupervisor`` (``_live/_session.py``)
whose ranks start and stop through the cluster's agents (``ClusterSupervisor``'s start and
close, ``_remote_run.py``): every cell's output, values, failures, interrupts, timeouts and
deadlock checks are the local session's. The store is on rank 0's node, the counters'
mirrors in a kernel folder removed with the session.
"""

from __future__ import annotations

import shutil

from .._kernel._attempt import scratch_folder
from .._kernel._output import OutputRouter
from .._kernel._plan import LaunchPlan
from .._live._session import SessionSupervisor
from ._gang import Gang
from ._remote_run import ClusterSupervisor, cluster_env


class ClusterSession(ClusterSupervisor, SessionSupervisor):
    """A session supervisor whose ranks run on the gang's nodes."""

    def __init__(
        self,
        plan: LaunchPlan,
        worker_env: list[dict[str, str]],
        router: OutputRouter,
        gang: Gang,
        folder: str,
    ) -> None:
        super().__init__(plan, worker_env, router, None, gang)
        self._folder = folder
        gang.session = self  # its agents run no launch until this session closes

    def _rank_endpoints(self) -> list[tuple[str, int]]:
        """Every rank's TCP socket addresses, read by each node's agent (the ranks run
        there): what idle ranks drop their connections to, to free a blocked one."""
        links = self._forwarder.links if self._forwarder is not None else []
        found: set[tuple[str, int]] = set()
        for link in links:
            found.update((str(ip), int(port)) for ip, port in link.call("endpoints") or [])
        return sorted(found)

    def _close(self) -> None:
        try:
            super()._close()
        finally:
            shutil.rmtree(self._folder, ignore_errors=True)
            if self._gang.session is self:
                self._gang.session = None


def start_session(
    gang: Gang, plan: LaunchPlan, number: int, router: OutputRouter
) -> ClusterSession:
    """Start a session's ranks on the gang (each with its process group up), or raise."""
    folder = scratch_folder("nb_dist_cluster_ranks_")
    try:
        address, port = gang.open_store(plan.world_size)
        envs = [cluster_env(plan, gang, r, address, port, number, folder) for r in plan.ranks]
        session = ClusterSession(plan, envs, router, gang, folder)
    except BaseException:
        shutil.rmtree(folder, ignore_errors=True)
        raise
    session.start()  # on failure it closes itself (folder included) and raises
    return session
