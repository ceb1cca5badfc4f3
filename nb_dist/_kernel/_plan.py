"""The launch plan: every argument checked in one documented order, then one frozen plan.

:func:`check_arguments` (steps 1 to 3), the transport's decision of where the ranks go
(``Transport.decide``; this machine's, ``_local.decide_here``: steps 4 and 5) and
:func:`place` (the rules for every transport: start method, threads, the ``"auto"``
rendezvous timeout; steps 6 and 7) turn ``notebook_launcher``'s arguments into a
:class:`LaunchPlan` before anything starts, checking in this order (the first problem found
is the one reported):

1. a launch from inside a rank of a launch;
2. each argument on its own, in the order of the signature (types, ranges, choices);
3. combinations of arguments (multi-node needs a port and no restarts);
4. the kernel's state: a process group, Accelerate state;
5. devices: a throw-away child counts GPUs and tells whether CUDA already poisoned fork
   (this decides ``num_processes=None``), without touching CUDA in the kernel;
6. threads that fork can give (the kernel's OpenMP pool, see ``_openmp.py``);
7. for spawn/forkserver, shipping the function by value (cloudpickle).

The plan then says everything an attempt needs, as plain data: ranks, devices, backend,
threads, timeouts, output modes, the function (or its bytes). Each rank's environment (a
superset of torchrun's) is built from it per attempt (``_run_setup.rank_env``), with the
rendezvous port of the store opened for that attempt.
"""

from __future__ import annotations

import dataclasses
import linecache
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from .._rank._spec import RankSpec
from .._shared import _shipping
from .._shared._precision import normalize_mixed_precision
from . import _openmp, _preflight, _warm
from ._errors import UnsafeLaunchError
from ._options import LaunchOptions
from ._output import DEFAULT_PREFIX, OUTPUT_MODES, RICH_OUTPUT_MODES
from ._tracebacks import cell_label


@dataclass(frozen=True)
class LaunchPlan:
    """Everything a launch will do, decided before anything starts."""

    function: Callable[..., Any]
    args: tuple[Any, ...]
    ranks: tuple[int, ...]  # the global rank of each rank started from here
    world_size: int
    node_rank: int
    num_nodes: int
    master_addr: str
    port: int | None  # None: the kernel's store picks a free one per attempt
    rdzv_id: str
    max_restarts: int
    start_method: str
    mixed_precision: str
    device: str
    use_gpu: bool
    threads: int | None
    init_process_group: bool
    output: str
    rich_output: str | frozenset[int]
    prefix: str
    timeout: float | None
    rendezvous_timeout: float | None
    hang_notice_after: float | None
    poll_interval: float
    warm_imports: bool
    monitor: bool
    debug: str | None = None  # "postmortem": keep the failing rank for the notebook's pdb
    session: bool = False  # live ranks (nb_dist.Ranks): ranks serve tasks
    payload: bytes | None = None  # spawn/forkserver: the function and args, by value
    linecache_entries: dict[str, Any] = field(default_factory=dict)
    notices: tuple[str, ...] = ()
    #: What the caller asked that the transport decides (``Transport.decide``), checked:
    #: how many ranks (``None``: one per GPU here), the threads per rank, and whether the
    #: rendezvous timeout is the transport's own (``"auto"`` and no ``rdzv_conf`` timeout;
    #: ``rendezvous_timeout`` is then ``None`` until :func:`place` sets the transport's).
    asked_processes: int | None = None
    asked_threads: int | None = None
    rendezvous_auto: bool = False
    #: The options given that place a launch by hand on machines (``use_port``,
    #: ``master_addr``, ``node_rank``, ``num_nodes``, ``rdzv_endpoint``), which a transport
    #: that places the ranks itself refuses by name.
    placed_by_hand: tuple[str, ...] = ()

    @property
    def nprocs(self) -> int:
        return len(self.ranks)

    @property
    def backend(self) -> str:
        return "nccl" if self.use_gpu else "gloo"

    def rank_spec(
        self, index: int, env: dict[str, str], close_fds: list[int], local_rank: int | None = None
    ) -> RankSpec:
        """What the rank at ``index`` (among the kernel's ranks) is told: its rank, its
        ``LOCAL_RANK`` (``index`` on this machine; on a cluster, its place on its node), its
        environment, and the function (or its bytes)."""
        shipped = self.payload is not None
        return RankSpec(
            rank=self.ranks[index],
            local_rank=index if local_rank is None else local_rank,
            env=env,
            threads=self.threads,
            init_process_group=self.init_process_group,
            backend=self.backend,
            use_gpu=self.use_gpu,
            parent_pid=os.getpid(),
            check_parent=self.start_method != "forkserver",
            function=None if shipped else self.function,
            args=() if shipped else self.args,
            payload=self.payload,
            linecache_entries=self.linecache_entries,
            sys_path=list(sys.path) if shipped else [],
            close_fds=close_fds,
            report_imports=self.warm_imports,
            session=self.session,
            debug=self.debug,
        )


@dataclass(frozen=True)
class Where:
    """What a transport decided about where a launch's ranks go (``Transport.decide``), for
    :func:`place`, which applies the rules every transport shares."""

    ranks: tuple[int, ...]  # the global rank of each rank started through this transport
    world_size: int
    num_nodes: int
    use_gpu: bool
    cores_per_rank: int
    #: The start method a ``"fork"`` request becomes where the starter cannot fork (a cluster
    #: node's agent: ``"forkserver"``; a system without fork: ``"spawn"``), else ``None``.
    instead_of_fork: str | None
    #: ``rendezvous_timeout="auto"`` for this transport.
    auto_rendezvous: float
    #: The function and args by value where the transport shipped them itself (with its own
    #: report of what did not pickle); else :func:`place` ships them for spawn/forkserver.
    payload: bytes | None = None
    notices: tuple[str, ...] = ()


def place(plan: LaunchPlan, where: Where) -> LaunchPlan:
    """The final plan: the checked ``plan`` (what the caller asked) on ``where``, by the
    rules every transport shares, in one place: the start method, the threads per rank
    (:func:`threads_for`; fewer where a fork would hang, step 6), the ``"auto"`` rendezvous
    timeout, and the function shipped by value for spawn and forkserver (step 7)."""
    method = plan.start_method
    if method == "fork" and where.instead_of_fork is not None:
        method = where.instead_of_fork
    threads = threads_for(plan.asked_threads, where.cores_per_rank)
    notices = [*plan.notices, *where.notices]
    if method == "fork":  # 6. Threads fork can give.
        threads, notice = _fork_safe_threads(threads, explicit=plan.asked_threads is not None)
        notices += [notice] if notice else []
    payload = where.payload  # 7. Shipping the function to fresh processes.
    if payload is None and method != "fork":
        payload = _pickle_for_spawn(plan.function, plan.args)
    return dataclasses.replace(
        plan,
        ranks=where.ranks,
        world_size=where.world_size,
        num_nodes=where.num_nodes,
        start_method=method,
        use_gpu=where.use_gpu,
        threads=threads,
        rendezvous_timeout=where.auto_rendezvous
        if plan.rendezvous_auto
        else plan.rendezvous_timeout,
        warm_imports=method == "fork" and plan.warm_imports and _warm.enabled(True),
        payload=payload,
        linecache_entries=cell_sources() if payload is not None else {},
        notices=tuple(notices),
    )


def check_arguments(
    function: Callable[..., Any], args: Sequence[Any], options: LaunchOptions
) -> LaunchPlan:
    """Steps 1 and 2: not inside a rank, then each argument on its own, in the order of the
    signature; step 3, the combinations. A plan whose ranks, devices, threads and payload the
    transport decides (``Transport.decide``, then :func:`place`)."""
    o = options
    _preflight.check_not_nested()
    _preflight.check_function(function)
    call_args = _preflight.check_args(args)
    if o.num_processes is not None:
        _preflight.check_positive_int("num_processes", o.num_processes, _NPROCS_HINT)
    mixed = normalize_mixed_precision(o.mixed_precision)
    nodes = _preflight.check_positive_int("num_nodes", o.num_nodes, _NODES_HINT)
    node = _preflight.check_node_rank(o.node_rank, nodes)
    addr, port = _rendezvous_address(o.rdzv_endpoint, o.master_addr, o.use_port)
    _check_rdzv_backend(o.rdzv_backend, nodes)
    conf_timeout, notices = read_rdzv_conf(o.rdzv_conf)
    restarts = _non_negative_int("max_restarts", o.max_restarts)
    poll = _preflight.check_seconds("monitor_interval", o.monitor_interval, default=0.1)
    method = _preflight.check_choice("start_method", o.start_method, _preflight.START_METHODS)
    limit = _preflight.check_seconds("timeout", o.timeout)
    output_mode = _preflight.check_choice("output", o.output, OUTPUT_MODES)
    _check_bool("init_process_group", o.init_process_group)
    device = _preflight.check_choice("device", o.device, _preflight.DEVICES)
    if o.threads_per_process is not None:
        _preflight.check_positive_int("threads_per_process", o.threads_per_process, _THREADS_HINT)
    hang_after = _preflight.check_seconds("hang_notice_after", o.hang_notice_after)
    _check_bool("monitor", o.monitor)
    rdzv_auto = o.rendezvous_timeout == "auto" and conf_timeout is None  # the transport's
    rdzv_limit = None if rdzv_auto else rendezvous_limit(o.rendezvous_timeout, conf_timeout)
    _check_bool("warm_imports", o.warm_imports)
    rich = _rich_output(o.rich_output)
    debug = o.debug
    if debug is not None:
        debug = _preflight.check_choice("debug", debug, DEBUG_MODES)
    _check_multi_node(nodes, port, restarts)  # 3. Combinations.
    return LaunchPlan(
        function=function, args=call_args, ranks=(), world_size=0, node_rank=node,
        num_nodes=nodes, master_addr=addr, port=port, rdzv_id=str(o.rdzv_id),
        max_restarts=restarts, start_method=method, mixed_precision=mixed, device=device,
        use_gpu=False, threads=None, init_process_group=o.init_process_group,
        output=output_mode, rich_output=rich,
        prefix=o.log_line_prefix_template or DEFAULT_PREFIX, timeout=limit,
        rendezvous_timeout=rdzv_limit, hang_notice_after=hang_after, poll_interval=poll or 0.1,
        warm_imports=o.warm_imports, monitor=o.monitor, notices=tuple(notices), debug=debug,
        asked_processes=o.num_processes, asked_threads=o.threads_per_process,
        rendezvous_auto=rdzv_auto, placed_by_hand=_placed_by_hand(o),
    )  # fmt: skip


def _placed_by_hand(options: LaunchOptions) -> tuple[str, ...]:
    defaults = LaunchOptions()
    names = ("use_port", "master_addr", "node_rank", "num_nodes", "rdzv_endpoint")
    return tuple(n for n in names if getattr(options, n) != getattr(defaults, n))


#: ``debug=``: ``None`` (no debugger), or keep the failing rank for a post-mortem.
DEBUG_MODES = ("postmortem",)


_NPROCS_HINT = "For CPU training on a laptop, 2 to 4 is a good choice."
_NODES_HINT = "Use num_nodes=1 for a launch on this machine only."
_THREADS_HINT = "Or leave it unset for cores / ranks."


def _check_bool(name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{name}={value!r} must be True or False.")


def _check_multi_node(num_nodes: int, port: int | None, restarts: int) -> None:
    if num_nodes > 1 and port is None:
        raise ValueError(
            f"use_port=None with num_nodes={num_nodes}: every machine must know the port in "
            "advance, so a multi-node launch needs an explicit port. Pass the same use_port "
            "(for example use_port=29500) on every node."
        )
    if restarts and num_nodes > 1:
        raise ValueError(
            f"max_restarts={restarts} with num_nodes={num_nodes}: restarts are coordinated on "
            "one machine only. Use max_restarts=0, or torchrun with an elastic rendezvous "
            "(--rdzv-backend=c10d --max-restarts=N) for fault-tolerant multi-node jobs."
        )


def _check_rdzv_backend(backend: object, num_nodes: int) -> None:
    """``"static"`` always; ``"c10d"`` on one machine, where it gives the same ranks."""
    name = backend.lower() if isinstance(backend, str) else None
    if name == "static" or (name == "c10d" and num_nodes == 1):
        # On one machine a c10d rendezvous assigns the same ranks a static one does (one
        # agent, local ranks in order), so the kernel-hosted static store stands in for it.
        return
    if name == "c10d":
        raise ValueError(
            f"rdzv_backend='c10d' with num_nodes={num_nodes}: an elastic rendezvous across "
            "machines (nodes joining and leaving, ranks assigned on arrival) needs torchrun's "
            "agent on every machine, which a notebook launch does not have. Use "
            "rdzv_backend='static' with the same master_addr and use_port on every machine "
            "(each with its own node_rank), or run a script with torchrun --rdzv-backend=c10d."
        )
    raise ValueError(
        f"rdzv_backend={backend!r} is not supported. Use 'static' (the default) or, on one "
        "machine, 'c10d' (the same ranks); for other elastic rendezvous backends run a script "
        "with torchrun."
    )


# rdzv_conf keys that mean "how long to wait for the ranks to join" (torchrun's names).
_RDZV_TIMEOUT_KEYS = ("join_timeout", "timeout")


def rendezvous_limit(
    rendezvous_timeout: float | str | None, conf_timeout: float | None
) -> float | None:
    """``rendezvous_timeout`` checked: ``"auto"`` is ``rdzv_conf``'s timeout here (without
    one, the transport's own, :attr:`Where.auto_rendezvous`)."""
    if rendezvous_timeout == "auto":
        rendezvous_timeout = conf_timeout
    return _preflight.check_seconds("rendezvous_timeout", rendezvous_timeout)


def read_rdzv_conf(conf: object) -> tuple[float | None, list[str]]:
    """The rendezvous timeout an Accelerate-style ``rdzv_conf`` asks for, and notices."""
    if conf is None or conf == {}:
        return None, []
    if not isinstance(conf, dict):
        raise TypeError(
            f"rdzv_conf={conf!r} must be a dict, e.g. rdzv_conf={{'timeout': 60}}, or None."
        )
    timeout = None
    for key in _RDZV_TIMEOUT_KEYS:
        if key in conf:
            timeout = _preflight.check_seconds(f"rdzv_conf[{key!r}]", conf[key])
            break
    ignored = sorted(str(k) for k in conf if k not in _RDZV_TIMEOUT_KEYS)
    notices = []
    if ignored:
        notices.append(
            f"rdzv_conf keys {', '.join(ignored)} configure torchrun's elastic agent and are "
            "ignored here; 'timeout'/'join_timeout' set rendezvous_timeout."
        )
    return timeout, notices


def _rich_output(value: object) -> str | frozenset[int]:
    if isinstance(value, str) and value.lower() in RICH_OUTPUT_MODES:
        return value.lower()
    ranks = [value] if isinstance(value, int) else value
    if (
        isinstance(ranks, (list, tuple, set, frozenset))
        and ranks
        and all(isinstance(r, int) and not isinstance(r, bool) and r >= 0 for r in ranks)
    ):
        return frozenset(ranks)
    raise ValueError(
        f"rich_output={value!r} is not supported. Use 'rank0', 'all', 'none', a rank such as 1, "
        "or a list of ranks such as [0, 1]."
    )


def _rendezvous_address(
    endpoint: object,
    master_addr: object,
    use_port: object,
) -> tuple[str, int | None]:
    if not isinstance(master_addr, str) or not master_addr:
        raise TypeError(f"master_addr={master_addr!r} must be a host name or IP address string.")
    port = _preflight.check_port(use_port)
    if endpoint:
        if not isinstance(endpoint, str) or ":" not in endpoint:
            raise ValueError(
                f"rdzv_endpoint={endpoint!r} must look like 'host:port', e.g. '10.0.0.1:29500'. "
                "Or pass master_addr and use_port instead."
            )
        host, _, endpoint_port = endpoint.rpartition(":")
        master_addr = host.strip("[]")
        try:
            port = _preflight.check_port(endpoint_port)
        except ValueError:
            raise ValueError(
                f"rdzv_endpoint={endpoint!r} has no valid port after the ':'. Use 'host:port' "
                "with a port from 1024 to 65535, e.g. '10.0.0.1:29500'."
            ) from None
    return master_addr, port


def _non_negative_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name}={value!r} must be a whole number, 0 or more.")
    return value


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
