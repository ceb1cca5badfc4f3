"""A launch's attempt on a cluster (or a live session there): its ranks on the gang's agents.

Runs in the kernel. Where the ranks go was decided by ``RayCluster.decide``
(``_ray_cluster.py``), which reserved the gang. :func:`open_ranks` opens the attempt as a
local one is opened, through ``_kernel/_attempt_setup.AttemptSetup`` (the scratch folder, the
store, each rank's environment), with the cluster's two differences: the store is the run's
on rank 0's node (:class:`RunStore`; ``MASTER_ADDR`` the node's cluster address) and each
rank's place comes from the gang's layout (:func:`places_on`: ``LOCAL_RANK``, ``NODE_RANK``,
``LOCAL_WORLD_SIZE`` by Ray node id, the node's id and gloo's interface there). The kernel's
own ``Supervisor`` then runs over the forwarded pipes, its ranks hosted by the agents
(:class:`ClusterHost`), for a launch's attempt and for live ranks alike. Nothing here calls
back into the cluster object: a host whose run lost a node gives the gang back itself, and
the cluster makes a new one at its next launch.
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Sequence
from multiprocessing.connection import Connection

from .._kernel._attempt_setup import AttemptSetup, Place, rank_spec
from .._kernel._plan import LaunchPlan
from .._kernel._rank_handle import Rank
from .._shared import _protocol
from .._shared._protocol import COLLECTIVES_ENV
from .._starter._parts import hold_out_of_forks, widen
from ._forward import Forwarder, OnLost
from ._gang import Gang, Layout, Node


def open_ranks(
    gang: Gang, plan: LaunchPlan, attempt: int
) -> tuple[list[dict[str, str]], list[Place], ClusterHost]:
    """Attempt ``attempt``'s ranks on the gang (or a live session's): each rank's environment
    and place, the store opened on rank 0's node, and the host that starts and ends them
    (all of it freed again if this fails)."""
    run = RunStore(gang)
    places = places_on(gang.layout, gang.nodes)
    setup = AttemptSetup(plan, attempt, "nb_dist_cluster_", run, places)
    return setup.envs, setup.places, ClusterHost(gang, run, setup, session=plan.session)


def places_on(lay: Layout, nodes: Sequence[Node]) -> list[Place]:
    """Each rank's place on the gang (on a cluster the kernel starts every rank, so a rank's
    index is its global rank): its node's ranks by Ray node id (``lay``), its node's id, and
    the interface gloo uses there (the caller's ``GLOO_SOCKET_IFNAME``, else the node's
    cluster interface; ``None`` if neither: gloo's own choice)."""
    chosen = os.environ.get("GLOO_SOCKET_IFNAME")
    return [
        Place(
            lay.local_rank[rank],
            lay.local_world_size[rank],
            lay.node_rank[rank],
            lay.num_nodes,
            node_id=nodes[agent].node_id,
            interface=chosen or nodes[agent].interface or None,
        )
        for rank, agent in enumerate(lay.agent)
    ]


class RunStore:
    """One run on the gang's agents as its ``AttemptSetup``'s store host: the run's store on
    rank 0's node (``Gang.open_store``), closed with the run, which :meth:`end` ends on the
    agents once (``Gang.end_run``: its store closed, what is left of its ranks killed)."""

    def __init__(self, gang: Gang) -> None:
        self._gang = gang
        #: The run's number: its store and its ranks carry it on the agents.
        self.number = gang.new_run()
        #: Ended on the agents (or by a start the gang refused, which ended it there).
        self.ended = False

    def open(self, world_size: int) -> tuple[str, int]:
        return self._gang.open_store(self.number, world_size)

    def end(self, forwarder: Forwarder | None = None) -> None:
        """End the run on the agents, once: ``forwarder`` stopped first and the run ended on
        each of its live agents; with none (no rank started), on the agent that may host
        its store."""
        if self.ended:
            return
        self.ended = True
        if forwarder is not None:
            forwarder.stop()
            self._gang.end_run(self.number, forwarder.links)
        else:
            self._gang.end_run(self.number)

    def close(self) -> None:
        self.end()


class ClusterHost:
    """The supervisor's :class:`~nb_dist._kernel._supervisor.RankHost` for ranks on the
    gang's nodes: the agents start them, their pipes are forwarded into the kernel's, and
    the run ends on every agent when the supervisor is done (or the held rank's post-mortem
    is); the scratch folder goes with it, and a gang that lost a node is given back (closed:
    the cluster replaces it at its next launch). A live session's host holds the gang until
    it closes."""

    def __init__(
        self, gang: Gang, run: RunStore, setup: AttemptSetup, session: bool = False
    ) -> None:
        self._gang, self._run = gang, run
        self._forwarder: Forwarder | None = None
        self._setup: AttemptSetup | None = setup
        self._places = setup.places
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
            rank_spec(plan, index, self._places[index], envs[index], [])
            for index in range(plan.nprocs)
        ]
        theirs = [rank.open_pipes() for rank in ranks]
        for ends in theirs:
            widen(ends["control"])  # a large value crosses the kernel's pipe in 1 MB writes
        mirrors = [env.get(COLLECTIVES_ENV) for env in envs]
        try:
            self._forwarder, processes = self._gang.start(
                self._run.number, plan.start_method, specs, theirs, mirrors,
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
            if self._forwarder is None:
                self._run.ended = True
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
        """Stop the run's forwarder and end the run on every agent (no rank started, the
        start failed: the run's store still goes), close the attempt's setup (its scratch
        folder), let a session's gang go, and give a gang that lost a node back (once)."""
        try:
            self._run.end(self._forwarder)
        finally:
            if self._setup is not None:
                self._setup.close()  # the run already ended: its folder
                self._setup = None
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
