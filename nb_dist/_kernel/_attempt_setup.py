"""What one attempt's ranks share in the kernel: the store, a scratch folder, their environments.

Each rank's environment (:func:`rank_env`: torchrun's variables, nb_dist's hand-offs, the
rank's error file and collective counter; a cluster adds its node's layout on top) and what
it is told at its start (:func:`rank_spec`) are decided here, from the plan, for every
transport.

A launch opens one :class:`AttemptSetup` per try (restarts open another); live ranks open one per
start and keep it until they stop. Either way the kernel hosts the rendezvous store (on node
0), each rank gets an error file and a collective counter in a private folder, and each
rank's environment names them. Runs in the kernel.
"""

from __future__ import annotations

import os
import shutil
import socket
import sys
from typing import Any

from .._rank._spec import RankSpec
from .._shared._net import is_loopback
from .._starter._parts import rank_files, scratch_folder
from . import _ports
from ._plan import LaunchPlan


class AttemptSetup:
    """The store, folder and per-rank environments of one attempt; :meth:`close` frees them."""

    def __init__(self, plan: LaunchPlan, attempt: int, folder_prefix: str) -> None:
        self.store: Any = None
        self.folder: str | None = scratch_folder(folder_prefix)
        try:
            if plan.node_rank == 0:
                # On one machine the store listens on master_addr only (127.0.0.1 unless
                # asked otherwise); placed by hand on several, on every interface.
                self.store = _ports.open_store(
                    plan.master_addr, plan.port, plan.world_size, only_there=plan.num_nodes == 1
                )
            self.port: int = self.store.port if self.store is not None else plan.port or 0
            self.envs = [
                rank_env(plan, local, self.port, attempt, self.folder)
                for local in range(plan.nprocs)
            ]
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """Stop hosting the store (its port is free again) and remove the folder. Idempotent."""
        if self.store is not None:
            _ports.forget_store(self.store)
            self.store = None  # drops the last reference: the server stops
        if self.folder is not None:
            shutil.rmtree(self.folder, ignore_errors=True)
            self.folder = None

    def __enter__(self) -> AttemptSetup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def rank_env(plan: LaunchPlan, index: int, port: int, attempt: int, folder: str) -> dict[str, str]:
    """The environment of the rank at ``index`` (among the kernel's ranks), with its error
    file and collective counter in ``folder``."""
    env = torchrun_env(plan, index, port, attempt)
    env.update(rank_files(folder, plan.ranks[index]))
    return env


def torchrun_env(plan: LaunchPlan, index: int, port: int, attempt: int) -> dict[str, str]:
    """The environment torchrun would give the rank at ``index``, plus nb_dist's own
    hand-offs. Its ``LOCAL_RANK`` is ``index``, as on this machine; a cluster's rank gets its
    place on its node instead (``_cluster/_remote_attempt.cluster_env``)."""
    rank, mixed = plan.ranks[index], plan.mixed_precision
    env = {
        "RANK": str(rank),
        "LOCAL_RANK": str(index),
        "WORLD_SIZE": str(plan.world_size),
        "LOCAL_WORLD_SIZE": str(plan.nprocs),
        "NODE_RANK": str(plan.node_rank),
        "GROUP_RANK": str(plan.node_rank),
        "GROUP_WORLD_SIZE": str(plan.num_nodes),
        "ROLE_RANK": str(rank),
        # What torch's elastic_launch (and so accelerate.notebook_launcher) gives.
        "ROLE_NAME": "default_role",
        "ROLE_WORLD_SIZE": str(plan.world_size),
        "MASTER_ADDR": plan.master_addr,
        "MASTER_PORT": str(port),
        # The kernel hosts the store (see ports.py): every rank connects as a client.
        "TORCHELASTIC_USE_AGENT_STORE": "True",
        "TORCHELASTIC_RESTART_COUNT": str(attempt),
        "TORCHELASTIC_MAX_RESTARTS": str(plan.max_restarts),
        "TORCHELASTIC_RUN_ID": str(plan.rdzv_id),
        # Where torch's @record writes a failing rank's error (torchrun sets one per rank).
        "ACCELERATE_MIXED_PRECISION": mixed,
        "NB_DIST_MIXED_PRECISION": mixed,
        # accelerate.notebook_launcher's own hand-offs, for code that reads them.
        "MIXED_PRECISION": mixed,
        "NPROC": str(plan.nprocs),
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
        # torch's own store-based barrier at the end of init_process_group and new_group:
        # without it a rank whose function returns right after init exits while a slower
        # peer is still connecting its mesh to it, and that peer fails with "Connection
        # closed by peer" (5 launches in 100 of init-and-return on a loaded 2-core box).
        # A user's own setting wins (os.environ is laid under this by the rank).
        "TORCH_DIST_INIT_BARRIER": os.environ.get("TORCH_DIST_INIT_BARRIER", "1"),
    }
    if plan.threads is not None:
        env["OMP_NUM_THREADS"] = str(plan.threads)
    if is_loopback(plan.master_addr) and not os.environ.get("GLOO_SOCKET_IFNAME"):
        # Gloo otherwise resolves the host name to pick an interface, which fails on
        # machines without network or with an unresolvable host name.
        interface = _loopback_interface()
        if interface:
            env["GLOO_SOCKET_IFNAME"] = interface
    if not plan.use_gpu:
        # Accelerate only picks MULTI_CPU (gloo, one process per rank) when told to use
        # the CPU; without it, Accelerator() in each rank would see a single process.
        env["ACCELERATE_USE_CPU"] = "true"
    if plan.device == "cpu" or (plan.device == "auto" and not plan.use_gpu):
        # CPU ranks see no GPU: code that calls init_process_group() without a backend
        # then gets gloo (with a GPU in view torch picks NCCL, which has no CPU tensors:
        # "No backend type associated with device type cpu"), and nothing touches one.
        env["CUDA_VISIBLE_DEVICES"] = ""
    return env


def _loopback_interface() -> str | None:
    names = (
        {name for _, name in socket.if_nameindex()} if hasattr(socket, "if_nameindex") else set()
    )
    for candidate in ("lo", "lo0"):
        if candidate in names:
            return candidate
    return None


def rank_spec(
    plan: LaunchPlan,
    index: int,
    env: dict[str, str],
    close_fds: list[int],
    local_rank: int | None = None,
) -> RankSpec:
    """What the rank at ``index`` (among the plan's ranks) is told: its rank, its
    ``LOCAL_RANK`` (``index`` on this machine; on a cluster, its place on its node), its
    environment, and the function (or its bytes)."""
    shipped = plan.payload is not None
    return RankSpec(
        rank=plan.ranks[index],
        local_rank=index if local_rank is None else local_rank,
        env=env,
        threads=plan.threads,
        init_process_group=plan.init_process_group,
        backend=plan.backend,
        use_gpu=plan.use_gpu,
        parent_pid=os.getpid(),
        check_parent=plan.start_method != "forkserver",
        function=None if shipped else plan.function,
        args=() if shipped else plan.args,
        payload=plan.payload,
        linecache_entries=plan.linecache_entries,
        sys_path=list(sys.path) if shipped else [],
        close_fds=close_fds,
        report_imports=plan.warm_imports,
        session=plan.session,
        debug=plan.debug,
    )
