"""The launch's agents: one node agent per placement-group bundle, and where each rank runs.

Runs in the kernel. A :class:`Gang` reserves the placement group (``_placement.py``), starts
one ``NodeAgent`` actor in each bundle (holding the whole bundle, so its ranks have the
resources), asks each where it is, and is kept across launches (warm relaunches: the agents
and their fork servers stay, also across ■) until the cluster is closed or a node is lost.
:func:`layout` gives each rank its node and local rank by Ray node id (not by address: nodes
may share one). :meth:`Gang.start` starts one run's ranks on the agents and
returns their forwarder.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

from .._rank._spec import RankSpec
from .._shared import _clock
from . import _placement
from ._connect import ClusterError
from ._forward import CALL_LIMIT, AgentLink, Forwarder, OnLost, RemoteProcess

#: How long agents may take to start (a fresh Ray worker imports torch and nb_dist).
AGENTS_LIMIT = 180.0
#: How long an agent may take to start its ranks (the first forkserver imports torch).
START_LIMIT = 180.0
#: Seconds a measured clock offset is used for (clocks drift a few ms an hour at worst).
CLOCKS_FRESH_FOR = 60.0
_runs = itertools.count(1)
_log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Node:
    """Where an agent runs: what ``NodeAgent.where`` says."""

    node_id: str
    address: str
    hostname: str
    interface: str | None
    cores: int
    boot_id: str | None  # the node's running system: equal to the kernel's, one clock


@dataclass(frozen=True)
class Layout:
    """For each rank (global rank = index): its agent, its place on that agent, its node."""

    agent: tuple[int, ...]
    position: tuple[int, ...]
    node_rank: tuple[int, ...]
    local_rank: tuple[int, ...]
    local_world_size: tuple[int, ...]
    num_nodes: int


def layout(node_ids: Sequence[str], counts: Sequence[int]) -> Layout:
    """Ranks numbered node by node, as torchrun numbers them (``counts[i]`` ranks on agent
    ``i`` at ``node_ids[i]``): nodes in order of first appearance, a node's agents in their
    order, so each node's ranks are consecutive (``init_device_mesh`` and hybrid sharding
    group ranks on that) and local ranks count across a node's agents."""
    nodes: dict[str, int] = {}
    for node_id in node_ids:
        nodes.setdefault(node_id, len(nodes))
    order = sorted(range(len(node_ids)), key=lambda i: nodes[node_ids[i]])  # stable
    agent, position, node_rank, local_rank = [], [], [], []
    per_node: dict[int, int] = {}
    for index in order:
        number = nodes[node_ids[index]]
        for place in range(counts[index]):
            agent.append(index)
            position.append(place)
            node_rank.append(number)
            local_rank.append(per_node.get(number, 0))
            per_node[number] = per_node.get(number, 0) + 1
    sizes = tuple(per_node[n] for n in node_rank)
    return Layout(tuple(agent), tuple(position), tuple(node_rank), tuple(local_rank), sizes,
                  len(nodes))  # fmt: skip


def clock_offset(ask: Callable[[], float], tries: int = 3) -> float:
    """``kernel clock - node clock``: ``ask()`` reads the node's ``time.monotonic()``; of
    ``tries`` round trips the shortest is used, its middle taken as the moment of the reading
    (wrong by at most half that round trip, about a millisecond on one network)."""
    best: tuple[float, float] | None = None
    for _ in range(tries):
        sent = time.monotonic()
        theirs = ask()
        back = time.monotonic()
        if best is None or back - sent < best[0]:
            best = (back - sent, (sent + back) / 2 - theirs)
    assert best is not None
    return best[1]


def gang_key(
    nprocs: int, per_node: int, per_rank: dict[str, float], strategy: str
) -> tuple[object, ...]:
    """What a gang was reserved for: a launch asking the same reuses it. The start method is
    not part of it: each run tells the agents its own (``NodeAgent.start``), and the agent's
    fork server, started for forkserver, sits unused under a spawn launch."""
    return (nprocs, per_node, tuple(sorted(per_rank.items())), strategy)


class Gang:
    """A placement group and its agents, one per bundle."""

    def __init__(
        self, ray: Any, nprocs: int, per_node: int, per_rank: dict[str, float], strategy: str,
        timeout: float, method: str = "forkserver",
    ) -> None:  # fmt: skip
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from .._node._agent import NodeAgent

        self.ray = ray
        self.threads_per_rank = max(1, int(per_rank.get("CPU", 1)))
        #: Live ranks running on the agents (a session holds them until it closes:
        #: :meth:`hold`, :meth:`let_go`).
        self.session: object | None = None
        self.key = gang_key(nprocs, per_node, per_rank, strategy)
        self._answered_at = -math.inf  # when every agent last answered (healthy)
        asked = _placement.bundles(nprocs, per_node, per_rank)
        self.counts = [min(per_node, nprocs - i * per_node) for i in range(len(asked))]
        self.group: Any = _placement.reserve(ray, asked, strategy, timeout)
        self.agents: list[Any] = []
        try:
            # By reference: the agent's rank imports nb_dist._node._agent, and with it a
            # package whose API stays unimported (no torch, no widgets: nb_dist/__init__.py).
            remote = ray.remote(NodeAgent)
            for index, bundle in enumerate(asked):
                custom = {k: v for k, v in bundle.items() if k not in ("CPU", "GPU")}
                self.agents.append(
                    remote.options(
                        num_cpus=bundle.get("CPU", 0),
                        num_gpus=bundle.get("GPU", 0),
                        resources=custom or None,
                        max_concurrency=16,
                        scheduling_strategy=PlacementGroupSchedulingStrategy(self.group, index),
                    ).remote(method)
                )
            found = ray.get([a.where.remote() for a in self.agents], timeout=AGENTS_LIMIT)
            self.nodes = [Node(*where) for where in found]
            self.measure_clocks()
        except BaseException as exc:
            self.close()
            if isinstance(exc, ray.exceptions.GetTimeoutError):
                raise ClusterError(
                    f"The node agents did not start within {AGENTS_LIMIT:g} s. Check that "
                    "nb_dist and torch are installed on every node (the same versions as "
                    "here), then launch again."
                ) from None
            raise
        self.layout = layout([n.node_id for n in self.nodes], self.counts)

    def measure_clocks(self) -> None:
        """Per agent, what to add to a time on its node's monotonic clock (a rank's message
        stamps) to put it on this process's (``_protocol.on_kernel_clock``): 0 on this
        machine (one clock), else measured (:func:`clock_offset`). Measured again before a
        run when older than :data:`CLOCKS_FRESH_FOR`: two machines' clocks drift apart."""
        here = _clock.boot_id()
        self.clock_offsets: list[float] = [
            0.0 if here is not None and node.boot_id == here else clock_offset(self._clock_of(a))
            for node, a in zip(self.nodes, self.agents, strict=True)
        ]
        self._clocks_at = time.monotonic()

    def _clock_of(self, actor: Any) -> Callable[[], float]:
        return lambda: float(self.ray.get(actor.clock.remote(), timeout=CALL_LIMIT))

    def describe(self) -> str:
        """``"2 nodes (node 0: 10.0.0.1 (ab12cd34), ...)"``."""
        seen: dict[str, Node] = {}
        for node in self.nodes:
            seen.setdefault(node.node_id, node)
        listed = ", ".join(
            f"node {i}: {n.address} ({n.node_id[:8]})" for i, n in enumerate(seen.values())
        )
        return f"{len(seen)} node(s) ({listed})"

    def new_run(self) -> int:
        """The number of a new run on these agents: its store and its ranks carry it."""
        return next(_runs)

    def open_store(self, run: int, world_size: int) -> tuple[str, int]:
        """Run ``run``'s rendezvous store on rank 0's node: (its address, its port). It is
        closed with the run (:meth:`end_run`, whether or not its ranks started)."""
        node = self.nodes[self.layout.agent[0]]
        # The first call imports torch in that agent (agents start without it), which takes
        # as long as a first start does: 1.5 s on an idle 2-core box, over 30 s under load.
        port = self.ray.get(
            self.agents[self.layout.agent[0]].open_store.remote(run, node.address, world_size),
            timeout=START_LIMIT,
        )
        return node.address, int(port)

    def start(
        self,
        run: int,
        method: str,
        specs: Sequence[RankSpec],
        theirs: Sequence[dict[str, Connection]],
        mirrors: Sequence[str | None],
        on_lost: Callable[[int], OnLost],
    ) -> tuple[Forwarder, list[RemoteProcess]]:
        """Start one run's ranks (``specs[r]`` for rank ``r``, ``theirs[r]`` its local pipe
        ends); the forwarder (started) and each rank's process. A start that raises has ended
        the run on every agent (:meth:`end_run`): nothing of it is left there."""
        if time.monotonic() - self._clocks_at > CLOCKS_FRESH_FOR:
            with contextlib.suppress(Exception):  # kept as they were; a lost agent is found below
                self.measure_clocks()
        lay = self.layout
        links: list[AgentLink] = []
        forwarder: Forwarder | None = None
        try:
            links += [
                AgentLink(self.ray, actor, run, self.nodes[i].address, self.clock_offsets[i])
                for i, actor in enumerate(self.agents)
            ]
            for rank in range(len(specs)):
                links[lay.agent[rank]].add_rank(lay.position[rank], theirs[rank], mirrors[rank])
            refs = [
                actor.start.remote(
                    run, method, [specs[r] for r in range(len(specs)) if lay.agent[r] == i]
                )
                for i, actor in enumerate(self.agents)
            ]
            pids = self.ray.get(refs, timeout=START_LIMIT)
            forwarder = Forwarder(self.ray, links)  # only now: its threads start with it
            forwarder.start()
        except BaseException:  # the agents' own error (or ■) is what the cell shows
            if forwarder is not None:
                with contextlib.suppress(Exception):  # e.g. a thread that never started
                    forwarder.stop()
            self.end_run(run, links if len(links) == len(self.agents) else None)
            for link in links:
                link.close()
            raise
        processes = [
            RemoteProcess(
                links[lay.agent[r]], lay.position[r], pids[lay.agent[r]][lay.position[r]],
                on_lost(r),
            )
            for r in range(len(specs))
        ]  # fmt: skip
        return forwarder, processes

    def end_run(self, run: int, links: Sequence[AgentLink] | None = None) -> None:
        """Tell the agents run ``run`` is over (what is left of it is killed there, and its
        store closed): every live agent of ``links``, or, for a run whose ranks were never
        started (``None``), the agent that may host its store."""
        if links is None:
            agents = [self.agents[self.layout.agent[0]]]
        else:
            agents = [link.actor for link in links if link.lost is None]
        try:
            self.ray.get([agent.end_run.remote(run) for agent in agents], timeout=CALL_LIMIT)
        except Exception:  # an agent lost now is found (and replaced) by the next launch
            _log.info("ending run %d on the agents failed", run, exc_info=True)

    def hold(self, session: object) -> None:
        """A live session runs on these agents: no launch until it lets them go."""
        self.session = session

    def let_go(self, session: object) -> None:
        """``session`` has closed (a later session's hold is kept)."""
        if self.session is session:
            self.session = None

    def wait_ready(self) -> None:
        """Until every agent's fork server is up (torch imported there), at most
        ``START_LIMIT`` seconds."""
        self.ray.get([a.ready.remote(START_LIMIT) for a in self.agents], timeout=START_LIMIT + 5)

    def healthy(self, fresh_for: float = 0.0) -> bool:
        """Every agent still answers (else the gang is replaced before a launch); without
        asking again if they all answered within the last ``fresh_for`` s (a launch's plan
        and its first attempt, a moment apart, ask once)."""
        if time.monotonic() - self._answered_at < fresh_for:
            return True
        try:
            self.ray.get([a.where.remote() for a in self.agents], timeout=CALL_LIMIT)
        except Exception:
            return False
        self._answered_at = time.monotonic()
        return True

    @property
    def closed(self) -> bool:
        """Given back (:meth:`close`): no agents, no placement group."""
        return self.group is None

    def close(self) -> None:
        """Kill the agents (their ranks die with them) and remove the placement group."""
        for actor in self.agents:
            with contextlib.suppress(Exception):  # already gone
                self.ray.kill(actor, no_restart=True)
        self.agents = []
        if self.group is not None:
            with contextlib.suppress(Exception):  # already removed (the cluster is gone)
                _placement.release(self.group)
            self.group = None
