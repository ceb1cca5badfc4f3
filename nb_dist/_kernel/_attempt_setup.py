"""What one attempt's ranks share, for every transport: the store, a scratch folder, their
places and environments.

A transport decides where each rank is (its :class:`Place`: on this machine from the plan,
``_local.places_here``; on a cluster from its gang's layout, which a lost node changes,
``_cluster/_remote_attempt.places_on``) and where the rendezvous store is hosted (a
:class:`StoreHost`: the kernel's own, ``_local.KernelStore``, or the one on rank 0's node
agent, ``_cluster/_remote_attempt.RunStore``); :class:`AttemptSetup` does the rest the same
way for both: the scratch folder, the store opened, each rank's environment
(:func:`rank_env`: torchrun's variables, nb_dist's hand-offs, the rank's error file and
collective counter), all freed again if any of it fails. What a rank is told at its start is
:func:`rank_spec`. Each variable is written once: by :func:`torchrun_env`, the files' by
``_starter/_parts.rank_files`` (on a cluster a node's agent gives the rank its own files there,
the kernel's being their mirrors).

A launch opens one :class:`AttemptSetup` per try (restarts open another); live ranks open one
per start and keep it until they stop; the transport's ``RankHost`` closes it. Runs in the
kernel.
"""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from .._rank._spec import RankSpec
from .._starter._parts import rank_files, scratch_folder
from ._plan import LaunchPlan


@dataclass(frozen=True)
class Place:
    """Where one rank is among an attempt's machines, decided once per attempt by its
    transport: its place on its node (``LOCAL_RANK`` of ``LOCAL_WORLD_SIZE``), its node's
    (``NODE_RANK`` of ``num_nodes``), and, where the transport knows them, the node's id
    (``NB_DIST_NODE_ID``: a Ray node's, for code that asks) and the interface gloo uses there
    (``GLOO_SOCKET_IFNAME``; ``None``: gloo's own choice, or the caller's variable, which the
    rank inherits). Written into the rank's environment by :func:`torchrun_env`, told to the
    rank by :func:`rank_spec`, and handed to the supervisor with the environments."""

    local_rank: int
    local_world_size: int
    node_rank: int
    num_nodes: int
    node_id: str | None = None
    interface: str | None = None


class StoreHost(Protocol):
    """Where an attempt's rendezvous store is hosted (the kernel, a node's agent)."""

    def open(self, world_size: int) -> tuple[str, int]:
        """The store for ``world_size`` ranks, opened where this host keeps it: the address
        and port the ranks reach it at (``MASTER_ADDR``, ``MASTER_PORT``)."""
        ...

    def close(self) -> None:
        """Stop hosting it; idempotent, and also called after an :meth:`open` that raised."""
        ...


class AttemptSetup:
    """One attempt's scratch folder, its store (opened through ``store``) and each rank's
    environment at its place (``places[i]`` for the rank at index ``i``); :meth:`close`
    frees them, as a failure while they are made does."""

    def __init__(
        self,
        plan: LaunchPlan,
        attempt: int,
        folder_prefix: str,
        store: StoreHost,
        places: Sequence[Place],
    ) -> None:
        self.store = store
        self.places = list(places)
        self.folder: str | None = scratch_folder(folder_prefix)
        try:
            address, self.port = store.open(plan.world_size)
            self.envs = [
                rank_env(plan, index, place, address, self.port, attempt, self.folder)
                for index, place in enumerate(self.places)
            ]
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """Stop hosting the store (its port is free again) and remove the folder. Idempotent."""
        try:
            self.store.close()
        finally:
            if self.folder is not None:
                shutil.rmtree(self.folder, ignore_errors=True)
                self.folder = None

    def __enter__(self) -> AttemptSetup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def rank_env(
    plan: LaunchPlan, index: int, place: Place, address: str, port: int, attempt: int, folder: str
) -> dict[str, str]:
    """The environment of the rank at ``index`` (among the plan's ranks) at ``place``, the
    store at ``address:port``, with its error file and collective counter in ``folder``."""
    env = torchrun_env(plan, index, place, address, port, attempt)
    env.update(rank_files(folder, plan.ranks[index]))
    return env


def torchrun_env(
    plan: LaunchPlan, index: int, place: Place, address: str, port: int, attempt: int
) -> dict[str, str]:
    """The environment torchrun would give the rank at ``index`` at ``place`` (its node's
    ranks and nodes, as its transport decided them), the store at ``address:port``, plus
    nb_dist's own hand-offs."""
    rank, mixed = plan.ranks[index], plan.mixed_precision
    env = {
        "RANK": str(rank),
        "LOCAL_RANK": str(place.local_rank),
        "WORLD_SIZE": str(plan.world_size),
        "LOCAL_WORLD_SIZE": str(place.local_world_size),
        "NODE_RANK": str(place.node_rank),
        "GROUP_RANK": str(place.node_rank),
        "GROUP_WORLD_SIZE": str(place.num_nodes),
        "ROLE_RANK": str(rank),
        # What torch's elastic_launch (and so accelerate.notebook_launcher) gives.
        "ROLE_NAME": "default_role",
        "ROLE_WORLD_SIZE": str(plan.world_size),
        "MASTER_ADDR": address,
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
        "NPROC": str(place.local_world_size),
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
    if place.interface:
        env["GLOO_SOCKET_IFNAME"] = place.interface
    if place.node_id is not None:
        env["NB_DIST_NODE_ID"] = place.node_id
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


def rank_spec(
    plan: LaunchPlan, index: int, place: Place, env: dict[str, str], close_fds: list[int]
) -> RankSpec:
    """What the rank at ``index`` (among the plan's ranks) is told: its rank, its local rank
    (its ``place`` on its node), its environment, and the function (or its bytes)."""
    shipped = plan.payload is not None
    return RankSpec(
        rank=plan.ranks[index],
        local_rank=place.local_rank,
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
