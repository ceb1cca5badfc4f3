"""``nb_dist.RayCluster``: where a launch's ranks run when one machine is not enough.

Runs in the kernel. ``notebook_launcher(fn, num_processes=8, cluster=RayCluster(...))``
gives the launch to the cluster, its transport (``_kernel/_transport.py``): it reserves one
placement-group bundle per node (``processes_per_node`` ranks' ``resources_per_rank``
each), puts a node agent in each and keeps them for later launches (the next launch reuses
the agents and their fork servers), and runs each attempt over them (``_remote_attempt.py``).
■ stops the ranks and keeps the agents warm; :meth:`close` (or the end of a ``with`` block,
or a lost node) gives the agents and the placement group back; when the kernel dies, Ray
removes both with its driver.

Where a launch's ranks go is decided here, as ``_kernel/_local.py`` decides it for this
machine: :meth:`RayCluster.decide` refuses what a cluster cannot do, ships the function by
value (naming what did not pickle) before any node is reserved, reserves the gang
(``_gang.py``, ``_placement.py``), and :func:`where_on` says, from the gang, where the ranks
go; ``_plan.plan_on`` then finishes the plan by the rules every transport shares.
"""

from __future__ import annotations

import atexit
import logging
import threading
import types
import weakref
from collections.abc import Callable, Mapping
from typing import Any

from .._kernel._arguments import Asked, check_positive_int
from .._kernel._attempt_setup import Place
from .._kernel._plan import LaunchPlan, Where, start_method_on
from .._shared import _protocol, _shipping
from . import _connect, _placement, _remote_attempt
from ._gang import Gang, gang_key
from ._remote_attempt import ClusterHost

_log = logging.getLogger(__name__)
#: Agents that answered this recently count as healthy without asking again: a launch's
#: plan (``decide``) and its first attempt (``open``) reserve the same gang, checked once.
ANSWERED_FRESH = 2.0
_open: weakref.WeakSet[RayCluster] = weakref.WeakSet()
#: What ``start_method="fork"`` becomes on a cluster: a node's agent is a Ray worker, whose
#: threads a fork would copy mid-flight; its fork server forks clean ranks.
FORK_INSTEAD = "forkserver"


class RayCluster:
    """A Ray cluster to launch on: ``notebook_launcher(..., cluster=RayCluster(...))``.

    Args:
        address: the cluster's address as ``ray.init`` takes it: ``"auto"`` (the cluster
            this machine belongs to), ``"ray://HOST:10001"``, or ``"HOST:6379"``. A kernel
            already connected to Ray (``ray.init`` in an earlier cell) keeps its connection.
        processes_per_node: ranks per node (one placement-group bundle each).
        placement: Ray's placement strategy for the bundles: ``"PACK"`` (default),
            ``"SPREAD"``, ``"STRICT_PACK"`` or ``"STRICT_SPREAD"`` (one node per bundle).
        resources_per_rank: what each rank reserves, e.g. ``{"CPU": 4, "GPU": 1}``
            (default ``{"CPU": 1}``). With a GPU per rank the ranks use NCCL on their GPUs.
        placement_timeout: seconds Ray may take to place the bundles before the launch is
            refused, naming what was asked and what is free (Ray itself would wait forever).
        num_processes: the ranks your launches will ask for. Given, the agents and their
            fork servers (which import torch) start now, in the background, so a launch a
            cell later finds them warm; a launch before they are ready waits for them, and
            one with another ``num_processes`` makes its own. ``None``: at the first launch.
    """

    def __init__(
        self,
        address: str = "auto",
        *,
        processes_per_node: int = 1,
        placement: str = "PACK",
        resources_per_rank: Mapping[str, float] | None = None,
        placement_timeout: float = 10.0,
        num_processes: int | None = None,
    ) -> None:
        if not isinstance(address, str) or not address:
            raise TypeError(f"address={address!r} must be a string such as 'auto'.")
        check_positive_int(
            "processes_per_node", processes_per_node, "For example the node's GPU count."
        )
        if placement not in _placement.STRATEGIES:
            raise ValueError(
                f"placement={placement!r} is not one of Ray's strategies: "
                f"{', '.join(_placement.STRATEGIES)}."
            )
        per_rank = dict(resources_per_rank) if resources_per_rank is not None else {"CPU": 1.0}
        for key, value in per_rank.items():
            if (
                not isinstance(key, str)
                or isinstance(value, bool)
                or not (isinstance(value, (int, float)) and value >= 0)
            ):
                raise ValueError(
                    f"resources_per_rank={resources_per_rank!r}: each entry must be a resource "
                    "name and a number, 0 or more, e.g. {'CPU': 2, 'GPU': 1}."
                )
        if (
            isinstance(placement_timeout, bool)
            or not isinstance(placement_timeout, (int, float))
            or placement_timeout <= 0
        ):
            raise ValueError(
                f"placement_timeout={placement_timeout!r} must be a number of seconds above 0."
            )
        self.address = address
        self.processes_per_node = processes_per_node
        self.placement = placement
        self.resources_per_rank = {k: float(v) for k, v in per_rank.items()}
        self.placement_timeout = float(placement_timeout)
        if num_processes is not None:
            check_positive_int(
                "num_processes", num_processes,
                "Give the ranks your launches will ask for, or None to start the agents at "
                "the first launch.",
            )  # fmt: skip
        self._ray: Any = _connect.ray_module()
        _connect.connect(self._ray, address)
        self._gang: Gang | None = None
        #: One gang at a time: a launch and the background warm-up take turns here.
        self._lock = threading.Lock()
        self._warming: threading.Thread | None = None
        _open.add(self)
        if num_processes is not None:
            self._warming = threading.Thread(
                target=self._warm, args=(num_processes,), name="nb_dist-ray-warm", daemon=True
            )
            self._warming.start()

    def __repr__(self) -> str:
        return (
            f"RayCluster(address={self.address!r}, processes_per_node="
            f"{self.processes_per_node}, placement={self.placement!r}, "
            f"resources_per_rank={self.resources_per_rank!r})"
        )

    # ------------------------------------------------------------------ the transport
    def decide(self, asked: Asked) -> Where:
        """Where the launch's ranks go on this cluster (``_kernel/_transport.py``): what the
        cluster cannot do refused and the function shipped, then the nodes reserved (the
        gang, which the launch's first :meth:`open` takes)."""
        gpus = self.resources_per_rank.get("GPU", 0.0) > 0
        if asked.device == "cuda" and not gpus:
            raise ValueError(
                "device='cuda' on a cluster needs a GPU per rank: pass "
                "RayCluster(resources_per_rank={'GPU': 1, ...})."
            )
        use_gpu = gpus and asked.device != "cpu"
        nprocs = ranks_asked(asked)
        payload, shipped = ship(asked.function, asked.args)  # before nodes are reserved for it
        gang = self._gang_for(nprocs, start_method_on(asked.start_method, FORK_INSTEAD))
        return where_on(gang, nprocs, use_gpu, payload, shipped)

    def open(
        self, plan: LaunchPlan, attempt: int
    ) -> tuple[list[dict[str, str]], list[Place], ClusterHost]:
        """One attempt's ranks (or a live session's, ``nb_dist.Ranks(cluster=...)``) on the
        agents: their environments, their places on the gang's nodes (its layout now: a
        replaced gang's may differ) and their host; a gang that lost a node is given back
        when the host closes."""
        gang = self._gang_for(plan.nprocs, plan.start_method)  # decide's, unless lost since
        return _remote_attempt.open_ranks(gang, plan, attempt)

    def interrupted(self) -> None:
        """■ stopped the ranks (the run ended on every agent as the supervisor closed); the
        agents and their fork servers stay warm for the next launch, unless one no longer
        answers (then all are given back now, not at the next launch)."""
        gang = self._gang
        if gang is not None and gang.session is None and (gang.closed or not gang.healthy()):
            self._release()

    # ------------------------------------------------------------------ the agents
    def _warm(self, nprocs: int) -> None:
        """Start the agents for ``nprocs`` ranks (in the background); a failure is logged and
        the first launch makes its own gang, raising what stops it in the cell."""
        try:
            with self._lock:
                gang = self._gang_for_locked(nprocs, "forkserver")
                gang.wait_ready()  # the fork servers too: torch imported on every node
        except Exception:  # the launch makes its own gang and reports what stops it
            _log.info("starting the agents in the background failed", exc_info=True)

    def _wait_for_warming(self) -> None:
        warming = self._warming
        if warming is not None and warming is not threading.current_thread():
            warming.join()  # an interrupt lands here; the warm-up goes on, holding the lock
            self._warming = None

    def _gang_for(self, nprocs: int, method: str) -> Gang:
        self._wait_for_warming()
        with self._lock:
            return self._gang_for_locked(nprocs, method)

    def _gang_for_locked(self, nprocs: int, method: str) -> Gang:
        gang = self._gang
        if gang is not None and gang.session is not None:
            raise _connect.ClusterError(
                "This RayCluster's agents are running live ranks (nb_dist.Ranks(cluster=...)), "
                "and one set of agents runs one set of ranks at a time. Close the session "
                "(ranks.close()) first, or give this launch a RayCluster of its own."
            )
        key = gang_key(nprocs, self.processes_per_node, self.resources_per_rank, self.placement)
        if gang is not None and (
            gang.closed or gang.key != key or not gang.healthy(fresh_for=ANSWERED_FRESH)
        ):
            self._release()  # a gang whose run lost a node was closed by that run's host
            gang = None
        if gang is None:
            gang = self._gang = Gang(
                self._ray, nprocs, self.processes_per_node, self.resources_per_rank,
                self.placement, self.placement_timeout, method,
            )  # fmt: skip
        return gang

    def _release(self) -> None:
        gang, self._gang = self._gang, None
        if gang is not None:
            gang.close()

    def close(self) -> None:
        """Give the agents and the placement group back (the next launch makes new ones)."""
        self._wait_for_warming()
        with self._lock:
            self._release()

    def __enter__(self) -> RayCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# ---------------------------------------------------------------------- where the ranks go
def ranks_asked(asked: Asked) -> int:
    """How many ranks a launch on a cluster starts; what a cluster cannot do refused (before
    any node is reserved): placing ranks by hand, or one rank per local GPU."""
    given = ", ".join(asked.placed_by_hand)
    if given:
        raise ValueError(
            f"{given} place a launch by hand on several machines; with cluster= the "
            "cluster places the ranks, hosts the rendezvous on rank 0's node and picks its "
            f"port. Remove {given} (processes_per_node and placement are RayCluster's options)."
        )
    if asked.num_processes is None:
        raise ValueError(
            "num_processes=None means one process per local GPU; on a cluster say how many "
            "ranks to start in all, e.g. num_processes=8 (processes_per_node of them per node)."
        )
    return asked.num_processes


def where_on(gang: Gang, nprocs: int, use_gpu: bool, payload: bytes, shipped: str) -> Where:
    """Where ``nprocs`` ranks go on ``gang``'s nodes (read from the gang, nothing asked of
    the cluster): every rank started by the nodes' agents, ``"fork"`` becoming forkserver,
    the function ``shipped`` by value. The rules every transport shares (start method,
    threads, the ``"auto"`` rendezvous timeout) are then ``_plan.plan_on``'s."""
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


@atexit.register
def _close_all() -> None:
    for cluster in list(_open):
        cluster.close()
