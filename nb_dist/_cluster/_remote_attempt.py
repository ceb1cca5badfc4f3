"""A launch's attempt on a cluster (or a live session there): its ranks on the gang's agents.

Runs in the kernel. Where the ranks go was decided by ``RayCluster.decide``
(``_ray_cluster.py``), which reserved the gang. :func:`open_ranks` opens the rendezvous
store on rank 0's node and gives each rank the environment torchrun would give it there
(``LOCAL_RANK``, ``NODE_RANK``, ``LOCAL_WORLD_SIZE`` by Ray node id; ``MASTER_ADDR`` the
node's cluster address); the kernel's own ``Supervisor`` then runs over the forwarded pipes,
its ranks hosted by the agents (:class:`ClusterHost`), for a launch's attempt and for live
ranks alike. Nothing here calls back into the cluster object: a host whose run lost a node
gives the gang back itself, and the cluster makes a new one at its next launch.
"""

from __future__ import annotations

import os
import shutil
import weakref
from multiprocessing.connection import Connection

from .._kernel._attempt_setup import rank_env, rank_spec
from .._kernel._plan import LaunchPlan
from .._kernel._rank_handle import Rank
from .._shared import _protocol
from .._shared._protocol import COLLECTIVES_ENV
from .._starter._parts import hold_out_of_forks, scratch_folder, widen
from ._forward import Forwarder, OnLost
from ._gang import Gang


def open_ranks(
    gang: Gang, plan: LaunchPlan, attempt: int
) -> tuple[list[dict[str, str]], ClusterHost]:
    """Attempt ``attempt``'s ranks on the gang (or a live session's): each rank's environment,
    the store opened on rank 0's node, and the host that starts and ends them."""
    run = gang.new_run()
    folder = scratch_folder("nb_dist_cluster_")
    try:
        address, port = gang.open_store(run, plan.world_size)
        envs = [cluster_env(plan, gang, r, address, port, attempt, folder) for r in plan.ranks]
    except BaseException:
        gang.end_run(run)  # the store, if it was opened
        shutil.rmtree(folder, ignore_errors=True)
        raise
    return envs, ClusterHost(gang, run, folder, session=plan.session)


def cluster_env(
    plan: LaunchPlan, gang: Gang, rank: int, address: str, port: int, attempt: int, folder: str
) -> dict[str, str]:
    """Rank ``rank``'s environment: torchrun's, with its node's ranks, and its collective
    counter's mirror in ``folder`` (the agent gives the rank a counter on its node). On a
    cluster the kernel starts every rank, so a rank's index is its global rank."""
    env = rank_env(plan, rank, port, attempt, folder)
    lay = gang.layout
    node = gang.nodes[lay.agent[rank]]
    env.update(
        LOCAL_RANK=str(lay.local_rank[rank]),
        LOCAL_WORLD_SIZE=str(lay.local_world_size[rank]),
        NPROC=str(lay.local_world_size[rank]),
        NODE_RANK=str(lay.node_rank[rank]),
        GROUP_RANK=str(lay.node_rank[rank]),
        GROUP_WORLD_SIZE=str(lay.num_nodes),
        MASTER_ADDR=address,
        NB_DIST_NODE_ID=node.node_id,  # the rank's Ray node, for code that asks
    )
    env.pop("GLOO_SOCKET_IFNAME", None)
    chosen = os.environ.get("GLOO_SOCKET_IFNAME")
    if chosen or node.interface:
        env["GLOO_SOCKET_IFNAME"] = chosen or node.interface or ""
    return env


class ClusterHost:
    """The supervisor's :class:`~nb_dist._kernel._supervisor.RankHost` for ranks on the
    gang's nodes: the agents start them, their pipes are forwarded into the kernel's, and
    the run ends on every agent when the supervisor is done (or the held rank's post-mortem
    is); the scratch folder goes with it, and a gang that lost a node is given back (closed:
    the cluster replaces it at its next launch). A live session's host holds the gang until
    it closes."""

    def __init__(self, gang: Gang, run: int, folder: str, session: bool = False) -> None:
        self._gang, self._run = gang, run
        self._forwarder: Forwarder | None = None
        self._run_ended = False
        self._folder: str | None = folder
        self._session = session
        if session:
            gang.hold(self)  # its agents run no launch until this session closes

    @property
    def node_lost(self) -> bool:
        """Whether an agent (a node) was lost during the run."""
        links = self._forwarder.links if self._forwarder is not None else []
        return any(link.lost is not None for link in links)

    def start(
        self, plan: LaunchPlan, envs: list[dict[str, str]], ranks: list[Rank]
    ) -> Connection | None:
        lay = self._gang.layout
        specs = [
            rank_spec(plan, index, envs[index], [], local_rank=lay.local_rank[index])
            for index in range(plan.nprocs)
        ]
        theirs = [rank.open_pipes() for rank in ranks]
        for ends in theirs:
            widen(ends["control"])  # a large value crosses the kernel's pipe in 1 MB writes
        mirrors = [env.get(COLLECTIVES_ENV) for env in envs]
        try:
            self._forwarder, processes = self._gang.start(
                self._run, plan.start_method, specs, theirs, mirrors,
                lambda index: self._on_lost(ranks[index], index),
            )  # fmt: skip
            for index, (rank, process) in enumerate(zip(ranks, processes, strict=True)):
                rank.attach(process, self._gang.clock_offsets[lay.agent[index]])
            # This kernel's ends of these pipes stay out of any rank it forks later (a local
            # launch or session beside this one): a copy would keep them from EOF.
            hold_out_of_forks([*(c for rank in ranks for c in rank.kernel_ends()),
                               *(c for ends in theirs for c in ends.values())])  # fmt: skip
        except BaseException:
            # A start the gang refused was ended on every agent there (Gang.start).
            self._run_ended = self._forwarder is None
            for ends in theirs:
                for conn in ends.values():
                    conn.close()
            raise
        return None  # the agents hold the lifelines of their ranks

    def _on_lost(self, rank: Rank, index: int) -> OnLost:
        node = self._gang.nodes[self._gang.layout.agent[index]]
        # Weakly: the rank's RemoteProcess holds this callback, and the handle holds the
        # process and the rank's value; a strong reference would keep that value alive
        # until the cycle collector runs (64 MB results piled up in a kernel).
        handle = weakref.ref(rank)

        def lost(reason: str, at: float) -> None:
            # Even for a rank being stopped: another rank's failure may be the loss's first
            # sign (its peer's connection closed) and the stop its consequence. nb_dist never
            # loses an agent during a run itself (■ ends the run and keeps the agents).
            still = handle()
            if still is None:
                return
            still.lose(
                _protocol.Failed(
                    "NodeLostError",
                    f"rank {index} ran on Ray node {node.node_id[:8]} ({node.address}), which "
                    f"was lost during the launch ({reason}); its ranks ended with it. Check "
                    "the cluster (`ray status`), then launch again: the next launch places "
                    "its ranks on live nodes.",
                    "",
                    at,
                )
            )

        return lost

    def close(self) -> None:
        """Stop the run's forwarder and end the run on every agent, remove the scratch folder,
        let a session's gang go, and give a gang that lost a node back (once)."""
        try:
            if not self._run_ended:
                self._run_ended = True
                if self._forwarder is not None:
                    self._forwarder.stop()
                    self._gang.end_run(self._run, self._forwarder.links)
                else:  # no rank started (the start failed): the run's store still goes
                    self._gang.end_run(self._run)
        finally:
            if self._folder is not None:
                shutil.rmtree(self._folder, ignore_errors=True)
                self._folder = None
                self._gang.let_go(self)
                if self.node_lost:
                    self._gang.close()  # given back; the cluster's next launch makes another

    def endpoints(self) -> list[tuple[str, int]] | None:
        """Every rank's TCP socket addresses, read by each node's agent (the ranks run
        there): what idle ranks drop their connections to, to free a blocked one."""
        links = self._forwarder.links if self._forwarder is not None else []
        found: set[tuple[str, int]] = set()
        for link in links:
            found.update((str(ip), int(port)) for ip, port in link.call("endpoints") or [])
        return sorted(found)
