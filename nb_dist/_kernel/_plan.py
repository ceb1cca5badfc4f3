"""The launch plan: what the caller asked (``_arguments.Asked``) on where the ranks go.

``_transport.prepare`` runs three steps in order: the arguments are checked
(``_arguments.check_arguments``); the transport says where the ranks go (:class:`Where`,
from ``Transport.decide``: on this machine the kernel's state and its devices, counted by a
throw-away child without touching CUDA in the kernel, which decides ``num_processes=None``;
on a cluster its nodes); and :func:`plan_on` applies, in one place, the rules every transport
shares into one frozen :class:`LaunchPlan` of plain data:

- the start method ``"fork"`` becomes where it cannot be used;
- threads per rank (what fork can give: the kernel's OpenMP pool, see ``_openmp.py``);
- the ``"auto"`` rendezvous timeout (:func:`auto_rendezvous`);
- for spawn/forkserver, shipping the function by value (cloudpickle).

The plan then says everything an attempt needs: ranks, devices, backend, threads, timeouts,
output modes, the function (or its bytes). Each rank's environment (a superset of
torchrun's) is built from it per attempt (``_attempt_setup.rank_env``), with the rank's place
its transport decided for that attempt and the address and port of the store opened for it.
"""

from __future__ import annotations

import dataclasses
import linecache
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .._shared import _shipping
from . import _openmp, _warm
from ._arguments import Asked, Settings
from ._errors import UnsafeLaunchError
from ._tracebacks import cell_label


@dataclass(frozen=True, kw_only=True)
class LaunchPlan(Settings):
    """Everything a launch will do, decided before anything starts: the caller's settings
    and where the ranks go."""

    ranks: tuple[int, ...]  # the global rank of each rank started through this transport
    world_size: int
    num_nodes: int
    start_method: str
    use_gpu: bool
    threads: int | None
    rendezvous_timeout: float | None
    warm_imports: bool
    payload: bytes | None = None  # spawn/forkserver: the function and args, by value
    linecache_entries: dict[str, Any] = field(default_factory=dict)
    notices: tuple[str, ...] = ()

    @property
    def nprocs(self) -> int:
        return len(self.ranks)

    @property
    def backend(self) -> str:
        return "nccl" if self.use_gpu else "gloo"


@dataclass(frozen=True)
class Where:
    """What a transport decided about where a launch's ranks go (``Transport.decide``), for
    :func:`plan_on`, which applies the rules every transport shares."""

    ranks: tuple[int, ...]  # the global rank of each rank started through this transport
    world_size: int
    num_nodes: int
    use_gpu: bool
    cores_per_rank: int
    #: The start method a ``"fork"`` request becomes where the starter cannot fork (a cluster
    #: node's agent: ``"forkserver"``; a system without fork: ``"spawn"``), else ``None``.
    instead_of_fork: str | None
    #: Whether the ranks are started by agents on the cluster's nodes (each node starts its
    #: first fork server, and imports torch, at its own speed) rather than by this process;
    #: with :attr:`ranks` and :attr:`world_size`, what :func:`auto_rendezvous` decides from.
    started_by_agents: bool = False
    #: The function and args by value where the transport shipped them itself (with its own
    #: report of what did not pickle); else :func:`plan_on` ships them for spawn/forkserver.
    payload: bytes | None = None
    notices: tuple[str, ...] = ()


# ``rendezvous_timeout="auto"``: how long the first rank to reach init_process_group waits
# for the others before the launch is stopped with a report (torch itself would wait for
# minutes). Every rank started here, on this machine:
RENDEZVOUS_HERE = 20.0
# Started by the nodes' agents: each node's first fork server imports torch at its own speed.
RENDEZVOUS_ON_AGENTS = 120.0
# Some ranks started by hand on other machines (their cells may run later).
RENDEZVOUS_BY_HAND = 300.0


def auto_rendezvous(where: Where) -> float:
    """``rendezvous_timeout="auto"`` on ``where``, for every transport: the transport says
    only who starts the ranks (:attr:`Where.started_by_agents`, and whether this launch starts
    them all, :attr:`Where.ranks` of :attr:`Where.world_size`)."""
    if len(where.ranks) < where.world_size:
        return RENDEZVOUS_BY_HAND
    return RENDEZVOUS_ON_AGENTS if where.started_by_agents else RENDEZVOUS_HERE


def start_method_on(asked: str, instead_of_fork: str | None) -> str:
    """The start method a launch gets where ``"fork"`` becomes ``instead_of_fork``."""
    return instead_of_fork if asked == "fork" and instead_of_fork is not None else asked


def plan_on(asked: Asked, where: Where) -> LaunchPlan:
    """The plan: what was ``asked`` on ``where``, by the rules every transport shares, in
    one place: the start method, the threads per rank (:func:`threads_for`; fewer where a
    fork would hang, step 6), the ``"auto"`` rendezvous timeout (:func:`auto_rendezvous`),
    the function shipped by value for spawn and forkserver (step 7), and the warm imports
    (fork only)."""
    method = start_method_on(asked.start_method, where.instead_of_fork)
    threads = threads_for(asked.threads_per_process, where.cores_per_rank)
    notices = [*asked.notices, *where.notices]
    if method == "fork":  # 6. Threads fork can give.
        explicit = asked.threads_per_process is not None
        threads, notice = _fork_safe_threads(threads, explicit=explicit)
        notices += [notice] if notice else []
    payload = where.payload  # 7. Shipping the function to fresh processes.
    if payload is None and method != "fork":
        payload = _pickle_for_spawn(asked.function, asked.args)
    warm = method == "fork" and asked.warm_imports
    if warm:
        # Warm relaunches were switched off in this kernel: said once, by the first fork
        # launch that asked for them and was not refused.
        notice = _warm.take_notice()
        notices += [notice] if notice else []
    settings = {f.name: getattr(asked, f.name) for f in dataclasses.fields(Settings)}
    return LaunchPlan(
        **settings,
        ranks=where.ranks,
        world_size=where.world_size,
        num_nodes=where.num_nodes,
        start_method=method,
        use_gpu=where.use_gpu,
        threads=threads,
        rendezvous_timeout=auto_rendezvous(where)
        if asked.rendezvous_auto
        else asked.rendezvous_timeout,
        warm_imports=warm and _warm.enabled(True),
        payload=payload,
        linecache_entries=cell_sources() if payload is not None else {},
        notices=tuple(notices),
    )


def threads_for(threads_per_process: int | None, cores_per_rank: int) -> int | None:
    """Intra-op threads per rank, for every transport: the caller's ``threads_per_process``,
    else ``OMP_NUM_THREADS`` (applied in the rank too: a forked rank keeps the kernel's torch
    thread pool, which ignores a variable set after torch was imported; ``None`` where it is
    not a whole number, for the rank to read itself), else the cores each rank has."""
    if threads_per_process is not None:
        return threads_per_process
    user_value = os.environ.get("OMP_NUM_THREADS", "").strip()
    if user_value:
        return int(user_value) if user_value.isdigit() and int(user_value) > 0 else None
    return max(1, cores_per_rank)


def _fork_safe_threads(threads: int | None, explicit: bool) -> tuple[int | None, str | None]:
    """Threads per forked rank that cannot hang on the kernel's OpenMP pool, and a notice.

    See nb_dist/_openmp.py: the pool is released before forking; where it cannot be, a
    throw-away child tells whether fork with threads would hang, and then the launch uses one
    thread (or refuses an explicit ``threads_per_process > 1``).
    """
    wanted = threads if threads is not None else _kernel_threads()
    # Released whatever the threads: the function may raise its own thread count later
    # (torch.set_num_threads), and a kept pool would hang it then. About a millisecond.
    release = _openmp.release_pool()
    if wanted <= 1:
        return threads, None
    if release.status in ("released", "idle", "absent"):
        return threads, _openmp.release_notice(release, wanted)
    if not _openmp.pool_breaks_fork(wanted):
        return threads, None
    if explicit:
        raise UnsafeLaunchError(_openmp.fork_unsafe_message(wanted, release))
    return 1, _openmp.single_thread_notice(wanted, release)


def _kernel_threads() -> int:
    """Threads a forked rank inherits when the launcher does not set them."""

    torch = sys.modules.get("torch")
    return int(torch.get_num_threads()) if torch is not None else 1


def _pickle_for_spawn(function: Callable[..., Any], args: tuple[Any, ...]) -> bytes:
    """Ship the function and args by value, so functions defined in a cell work with spawn."""
    try:
        return _shipping.dumps((function, args))
    except Exception as exc:
        raise TypeError(
            f"start_method='spawn'/'forkserver' must send the function and args to fresh "
            f"processes, and this failed: {type(exc).__name__}: {exc}. Make the args picklable "
            "(no open files, locks or generators), create such objects inside the function, or "
            "use start_method='fork'."
        ) from exc


def cell_sources() -> dict[str, Any]:
    """linecache entries of notebook cells, so spawned ranks' tracebacks show the code.

    Each without a modification time: IPython 7 stamps its entries with one, and linecache
    then drops them in a process where no such file exists (a spawned rank), as a stale file's.
    """
    return {
        name: (entry[0], None, entry[2], name)
        for name, entry in linecache.cache.items()
        if len(entry) == 4 and cell_label(name)
    }
