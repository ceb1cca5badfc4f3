"""A launch on a cluster: the plan decided for the cluster's nodes, and one attempt's run.

Runs in the kernel. :func:`decide` says where the ranks go instead of this machine's
devices: the ranks start with forkserver (or spawn) on their nodes, the function and
its arguments are shipped by value (and the pre-flight names what was shipped, or which
argument or global did not pickle), and the placement group is reserved before anything
starts. :func:`open_ranks` opens the rendezvous store on rank 0's node and gives each rank the
environment torchrun would give it there (``LOCAL_RANK``, ``NODE_RANK``, ``LOCAL_WORLD_SIZE``
by Ray node id; ``MASTER_ADDR`` the node's cluster address); the kernel's own ``Supervisor``
then runs over the forwarded pipes, its ranks hosted by the agents (:class:`ClusterHost`),
for a launch's attempt and for live ranks alike.
"""

from __future__ import annotations

import os
import shutil
import types
import weakref
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

from .._kernel._arguments import Asked
from .._kernel._plan import LaunchPlan, Where, start_method_on
from .._kernel._rank_handle import Rank
from .._kernel._run_setup import rank_env, rank_spec
from .._shared import _protocol, _shipping
from .._shared._protocol import COLLECTIVES_ENV
from .._starter._run_parts import hold_out_of_forks, scratch_folder, widen
from ._forward import Forwarder, OnLost
from ._gang import Gang

#: What ``start_method="fork"`` becomes on a cluster: a node's agent is a Ray worker, whose
#: threads a fork would copy mid-flight; its fork server forks clean ranks.
FORK_INSTEAD = "forkserver"


def decide(gang_for: Callable[[int, str], Gang], asked: Asked, use_gpu: bool) -> Where:
    """Where a launch's ranks go on the cluster; ``gang_for(nprocs, start_method)`` reserves
    its nodes. The rules every transport shares (start method, threads, the ``"auto"``
    rendezvous timeout) are then ``_plan.plan_on``'s."""
    _refuse_placed_by_hand(asked)
    if asked.num_processes is None:
        raise ValueError(
            "num_processes=None means one process per local GPU; on a cluster say how many "
            "ranks to start in all, e.g. num_processes=8 (processes_per_node of them per node)."
        )
    nprocs = asked.num_processes
    payload, shipped = ship(asked.function, asked.args)  # before nodes are reserved for it
    gang = gang_for(nprocs, start_method_on(asked.start_method, FORK_INSTEAD))
    return Where(
        ranks=tuple(range(nprocs)),
        world_size=nprocs,
        num_nodes=gang.layout.num_nodes,
        use_gpu=use_gpu,
        cores_per_rank=gang.threads_per_rank,
        instead_of_fork=FORK_INSTEAD,
        started_by_agents=True,
        payload=payload,
        notices=(f"shipped {shipped} to {nprocs} ranks on {gang.describe()}.",),
    )


def _refuse_placed_by_hand(asked: Asked) -> None:
    given = ", ".join(asked.placed_by_hand)
    if given:
        raise ValueError(
            f"{given} place a launch by hand on several machines; with cluster= the "
            "cluster places the ranks, hosts the rendezvous on rank 0's node and picks its "
            f"port. Remove {given} (processes_per_node and placement are RayCluster's options)."
        )


def ship(function: Callable[..., Any], args: tuple[Any, ...]) -> tuple[bytes, str]:
    """The function and args by value (cloudpickle) and what was shipped, in words; a
    ``TypeError`` naming each argument or global that does not pickle."""
    globals_used = _globals_of(function)
    try:
        payload = _shipping.dumps((function, args))
    except Exception as exc:
        bad = [f"argument {i} ({_what(a, e)})" for i, a in enumerate(args) if (e := _fails(a))]
        bad += [
            f"global {n!r} ({_what(v, e)})" for n, v in globals_used.items() if (e := _fails(v))
        ]
        found = "; ".join(bad) or f"{type(exc).__name__}: {exc}"
        raise TypeError(
            f"A cluster launch ships {_name(function)} and its arguments to other machines "
            f"with cloudpickle, and this did not pickle: {found}. Create such objects inside "
            "the function (open files, locks, clients, generators), or pass what builds them."
        ) from None
    names = ", ".join(sorted(globals_used)) or "no globals"
    size = len(payload)
    shown = f"{size / 1024:.1f} kB" if size >= 1024 else f"{size} B"
    return payload, f"{_name(function)} with {names} and {len(args)} argument(s) ({shown})"


def _name(function: Callable[..., Any]) -> str:
    return f"{getattr(function, '__qualname__', type(function).__name__)}()"


def _globals_of(function: Callable[..., Any]) -> dict[str, Any]:
    """The globals ``function`` (and the functions nested in it) refers to by name."""
    code = getattr(function, "__code__", None)
    namespace = getattr(function, "__globals__", {})
    if code is None:
        return {}
    names: set[str] = set()
    stack = [code]
    while stack:
        current = stack.pop()
        names.update(current.co_names)
        stack.extend(c for c in current.co_consts if isinstance(c, types.CodeType))
    return {
        n: namespace[n]
        for n in sorted(names)
        if n in namespace and not isinstance(namespace[n], types.ModuleType)
    }


def _fails(value: Any) -> BaseException | None:
    try:
        _shipping.dumps(value)
    except Exception as exc:
        return exc
    return None


def _what(value: Any, exc: BaseException) -> str:
    return f"a {_protocol.type_name(value)}: {type(exc).__name__}: {exc}"


def open_ranks(
    gang: Gang, plan: LaunchPlan, attempt: int, on_lost: Callable[[], None]
) -> tuple[list[dict[str, str]], ClusterHost]:
    """Attempt ``attempt``'s ranks on the gang (or a live session's): each rank's environment,
    the store opened on rank 0's node, and the host that starts and ends them. ``on_lost()``
    runs when the host closes after a run that lost a node (or an agent)."""
    run = gang.new_run()
    folder = scratch_folder("nb_dist_cluster_")
    try:
        address, port = gang.open_store(run, plan.world_size)
        envs = [cluster_env(plan, gang, r, address, port, attempt, folder) for r in plan.ranks]
    except BaseException:
        gang.end_run(run)  # the store, if it was opened
        shutil.rmtree(folder, ignore_errors=True)
        raise
    return envs, ClusterHost(gang, run, folder, on_lost, session=plan.session)


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
    is); the scratch folder goes with it, and a gang that lost a node is given back
    (``on_lost``). A live session's host holds the gang until it closes."""

    def __init__(
        self, gang: Gang, run: int, folder: str, on_lost: Callable[[], None],
        session: bool = False,
    ) -> None:  # fmt: skip
        self._gang, self._run = gang, run
        self._forwarder: Forwarder | None = None
        self._run_ended = False
        self._folder: str | None = folder
        self._give_back = on_lost  # the gang, after a run that lost a node
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
                    self._give_back()

    def endpoints(self) -> list[tuple[str, int]] | None:
        """Every rank's TCP socket addresses, read by each node's agent (the ranks run
        there): what idle ranks drop their connections to, to free a blocked one."""
        links = self._forwarder.links if self._forwarder is not None else []
        found: set[tuple[str, int]] = set()
        for link in links:
            found.update((str(ip), int(port)) for ip, port in link.call("endpoints") or [])
        return sorted(found)
