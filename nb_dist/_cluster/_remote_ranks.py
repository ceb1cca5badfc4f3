"""Live ranks on a cluster (``nb_dist.Ranks(cluster=...)``): runs in the kernel.

The live ranks' ``SessionSupervisor`` (``_live/_session.py``) is the same as on one machine;
its host is a :class:`~_remote_run.ClusterHost` whose ranks start and stop through the
cluster's agents: every cell's output, values, failures, interrupts, timeouts and deadlock
checks are the local session's. The store is on rank 0's node, the counters' mirrors in a
kernel folder given back with the session (as are the agents, for launches).
"""

from __future__ import annotations

import shutil

from .._kernel._plan import LaunchPlan
from .._shared._starting import scratch_folder
from ._gang import Gang
from ._remote_run import ClusterHost, cluster_env


def session_host(
    gang: Gang, plan: LaunchPlan, number: int
) -> tuple[list[dict[str, str]], ClusterHost]:
    """Where a session's ranks run on the gang: each rank's environment (the store opened on
    rank 0's node) and the host that starts and ends them."""
    folder = scratch_folder("nb_dist_cluster_ranks_")
    try:
        address, port = gang.open_store(plan.world_size)
        envs = [cluster_env(plan, gang, r, address, port, number, folder) for r in plan.ranks]
    except BaseException:
        shutil.rmtree(folder, ignore_errors=True)
        raise
    return envs, ClusterHost(gang, session_folder=folder)
