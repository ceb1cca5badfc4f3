"""The local transport: a launch's ranks on this machine (``_transport.py``'s default).

Runs in the kernel. :meth:`LocalTransport.decide` is :func:`decide_here` (the kernel's
state, this machine's devices: how many ranks, GPUs or not);
:meth:`LocalTransport.open` decides each rank's place on this machine (:func:`places_here`,
from the plan) and opens, for one attempt or one start of live ranks, the scratch folder,
the kernel's store (:class:`KernelStore`) and the environments
(``_attempt_setup.AttemptSetup``), and gives them to a :class:`LocalHost`, which starts the
ranks (:func:`start_all`) and frees all of it when the run (or the session) is over.

Starting: each rank gets five pipes (four to the kernel, ``commands`` from it; see
``_protocol.py``) and two shared ones, the **lifeline** (the kernel keeps its only write end;
when the kernel dies, every rank reads EOF and kills itself, besides the parent-death signal)
and the **start gate** (no rank runs user code before all are started;
``_rank/_entry._wait_for_gate``), both from ``_starter/_parts.py``, which a cluster node's
agent uses too. A forked rank closes every kernel-side end it inherited (other ranks' read
ends, the lifeline's and the gate's write ends), or EOF would never come.
"""

from __future__ import annotations

import multiprocessing
import os
import socket
from collections.abc import Callable
from multiprocessing.connection import Connection
from multiprocessing.context import BaseContext
from typing import Any

from .._rank._spec import RankSpec
from .._shared._net import is_loopback
from .._starter import _parts, _processes
from .._starter._parts import Gate, held_fds, hold_out_of_forks
from . import _openmp, _ports, _preflight
from ._arguments import Asked
from ._attempt_setup import AttemptSetup, Place, rank_spec
from ._plan import LaunchPlan, Where
from ._rank_handle import Rank, kill_all

#: Builds one rank's spec from its local rank and the kernel-side fds it must close.
SpecFor = Callable[[int, list[int]], RankSpec]


def start_all(method: str, ranks: list[Rank], spec_for: SpecFor) -> Connection:
    """Start every rank, then open the gate (``_processes.start_ranks``); the lifeline's
    write end, for the kernel to keep. A forked rank is told every kernel-side end it
    inherited, to close: other ranks' pipes, the gate's and the lifeline's write ends."""

    def start_one(index: int, gate: Gate, context: BaseContext | None) -> None:
        rank = ranks[index]
        theirs = rank.open_pipes()
        kernel_fds = [c.fileno() for r in ranks for c in r.kernel_ends()]
        kernel_fds += [*gate.starter_fds(), *held_fds()]
        spec = spec_for(rank.index, kernel_fds)
        rank.attach(_processes.start_on_pipes(method, spec, theirs, gate, context))

    def kill_started() -> None:
        kill_all(ranks)

    lifeline = _processes.start_ranks(method, len(ranks), start_one, kill_started)
    hold_out_of_forks([lifeline, *(c for rank in ranks for c in rank.kernel_ends())])
    return lifeline


class KernelStore:
    """The ``StoreHost`` of a launch on this machine: the kernel hosts the store on node 0
    (``_ports.open_store``); on another node of a launch placed by hand, none is hosted here
    and the ranks reach node 0's at ``master_addr`` and the port asked for.

    :meth:`open` only opens the port; :meth:`serve` starts the store's server on it once the
    ranks are forked (``LocalHost.start``). Until then other machines' ranks that connect
    wait in the port's backlog, and no server thread runs while the kernel forks
    (``_parts.store_socket`` says why a fork beside it can hang a rank)."""

    def __init__(self, plan: LaunchPlan) -> None:
        self._plan = plan
        self._listener: socket.socket | None = None
        self._store: Any = None
        self._port: int | None = None
        self._world_size = 0

    def open(self, world_size: int) -> tuple[str, int]:
        plan = self._plan
        if plan.node_rank == 0:
            # On one machine the store listens on master_addr only (127.0.0.1 unless
            # asked otherwise); placed by hand on several, on every interface.
            self._listener = _ports.open_store(
                plan.master_addr, plan.port, only_there=plan.num_nodes == 1
            )
            self._port, self._world_size = self._listener.getsockname()[1], world_size
        return plan.master_addr, self._port if self._port is not None else plan.port or 0

    def serve(self) -> None:
        """Start the store's server on the opened port (nothing on a node that hosts none)."""
        if self._listener is not None:
            listener, self._listener = self._listener, None
            self._store = _parts.serve_store(listener, self._plan.master_addr, self._world_size)

    def close(self) -> None:
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        self._store = None  # drops the last reference: the server stops
        if self._port is not None:
            _ports.forget_store(self._port)
            self._port = None


def places_here(plan: LaunchPlan) -> list[Place]:
    """Each rank's place on this machine: its index among the kernel's ranks is its local
    rank, on node ``plan.node_rank`` of ``plan.num_nodes``; ranks that meet on a loopback
    address use the loopback interface for gloo unless the caller chose one."""
    interface = None
    if is_loopback(plan.master_addr) and not os.environ.get("GLOO_SOCKET_IFNAME"):
        # Gloo otherwise resolves the host name to pick an interface, which fails on
        # machines without network or with an unresolvable host name.
        interface = _loopback_interface()
    return [
        Place(local, plan.nprocs, plan.node_rank, plan.num_nodes, interface=interface)
        for local in range(plan.nprocs)
    ]


def _loopback_interface() -> str | None:
    names = (
        {name for _, name in socket.if_nameindex()} if hasattr(socket, "if_nameindex") else set()
    )
    for candidate in ("lo", "lo0"):
        if candidate in names:
            return candidate
    return None


class LocalHost:
    """The supervisor's ``RankHost`` for ranks on this machine (fork, spawn or forkserver):
    it owns what the ranks share (``setup``: the store, the folder), closed with it, and
    starts the store's server (``store``, the setup's) once the ranks are forked."""

    def __init__(self, setup: AttemptSetup, store: KernelStore, restart: bool) -> None:
        self._setup: AttemptSetup | None = setup
        self._store = store
        self._places = setup.places
        self._restart = restart

    def start(
        self, plan: LaunchPlan, envs: list[dict[str, str]], ranks: list[Rank]
    ) -> Connection | None:
        if plan.start_method == "fork" and self._restart:
            _openmp.release_pool()  # a restart forks again, and the kernel may have a pool again

        def spec_for(index: int, kernel_fds: list[int]) -> RankSpec:
            return rank_spec(plan, index, self._places[index], envs[index], kernel_fds)

        lifeline = start_all(plan.start_method, ranks, spec_for)
        # Every rank is forked: no fork runs beside the store's server thread. (If it cannot
        # start, the supervisor stops the started ranks, as for any failure to start.)
        self._store.serve()
        # Who may hold a port later: a busy port held by one of these is named as ours.
        _ports.remember_ranks([rank.outcome.pid for rank in ranks if rank.outcome.pid])
        return lifeline

    def close(self) -> None:
        # The ranks are reaped and their pipes closed by the supervisor.
        if self._setup is not None:
            self._setup.close()
            self._setup = None

    def endpoints(self) -> list[tuple[str, int]] | None:
        return None  # read on this machine by the kernel itself


def decide_here(asked: Asked) -> Where:
    """Steps 4 and 5 of ``_plan``'s order for ranks on this machine: the kernel's state,
    then its devices (how many ranks, GPUs or not)."""
    _preflight.check_process_group()  # 4. The kernel's state.
    _preflight.check_accelerate_state()
    # 5. Devices.
    use_gpu, nprocs, device_notice = _devices(asked.device, asked.num_processes, asked.start_method)
    return Where(
        ranks=tuple(asked.node_rank * nprocs + local for local in range(nprocs)),
        world_size=nprocs * asked.num_nodes,
        num_nodes=asked.num_nodes,
        use_gpu=use_gpu,
        cores_per_rank=_cores() // nprocs,
        # e.g. Windows: no fork; spawn ships the function with cloudpickle
        instead_of_fork=None if "fork" in multiprocessing.get_all_start_methods() else "spawn",
        notices=(device_notice,) if device_notice else (),
    )


def _devices(device: str, num_processes: int | None, method: str) -> tuple[bool, int, str | None]:
    """Whether ranks use GPUs, how many ranks, and a notice: :func:`device_choice` on what
    the probe sees (which never initializes CUDA); a poisoned fork is refused."""
    cuda = _preflight.probe_cuda() if device != "cpu" else _preflight.CudaState(0, False, None)
    use_gpu, num_processes, notice = device_choice(device, num_processes, cuda.gpus)
    if use_gpu and cuda.poisoned and method == "fork":
        raise _preflight.cuda_poisoned_error(cuda)
    return use_gpu, num_processes, notice


def device_choice(
    device: str, num_processes: int | None, gpus: int
) -> tuple[bool, int, str | None]:
    """Whether ranks use GPUs, how many ranks (``None``: one per GPU), and a notice, given
    the number of visible GPUs.

    With the default ``device="auto"``, more ranks than visible GPUs run on the CPU (gloo)
    with a notice, so a notebook written for a laptop also runs on a one-GPU machine (Colab);
    ``device="cuda"`` asks for GPUs, and too many ranks are refused."""
    use_gpu = device == "cuda" or (device == "auto" and gpus > 0)
    if use_gpu and gpus == 0:
        raise ValueError(
            "device='cuda' but no GPU is visible to this kernel (check CUDA_VISIBLE_DEVICES "
            "and the driver). Use device='cpu' (or the default 'auto') to run on CPU."
        )
    if num_processes is None:
        if not use_gpu:
            raise ValueError(
                "num_processes=None means one process per GPU, and no GPU is in use here. "
                "Say how many CPU processes to start, e.g. num_processes=2."
            )
        return True, gpus, None
    if use_gpu and device == "auto" and num_processes > gpus:
        return (
            False,
            num_processes,
            (
                f"num_processes={num_processes} but {gpus} GPU(s) are visible, so the ranks run "
                "on the CPU with gloo. For GPUs, pass device='cuda' with "
                f"num_processes={gpus} or fewer (one process per GPU)."
            ),
        )
    if use_gpu and num_processes > gpus:
        raise ValueError(
            f"num_processes={num_processes} with device='cuda' but only {gpus} GPU(s) are "
            f"visible: each process needs its own GPU. Use num_processes={gpus} or fewer, or "
            "device='cpu' (or the default 'auto', which runs more ranks than GPUs on the CPU)."
        )
    return use_gpu, num_processes, None


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        return os.cpu_count() or 1


class LocalTransport:
    """Ranks on this machine: the :class:`~_transport.Transport` of every launch without
    ``cluster=``."""

    def decide(self, asked: Asked) -> Where:
        return decide_here(asked)

    def open(
        self, plan: LaunchPlan, attempt: int
    ) -> tuple[list[dict[str, str]], list[Place], LocalHost]:
        prefix = "nb_dist_ranks_" if plan.session else "nb_dist_run_"
        store = KernelStore(plan)
        setup = AttemptSetup(plan, attempt, prefix, store, places_here(plan))
        return setup.envs, setup.places, LocalHost(setup, store, restart=attempt > 0)

    def interrupted(self) -> None:
        pass  # the ranks are stopped; the fork server and warm imports stay as they are
