"""What one attempt's ranks share in the kernel: the store, a scratch folder, their environments.

A launch opens one :class:`AttemptSetup` per try (restarts open another); live ranks open one per
start and keep it until they stop. Either way the kernel hosts the rendezvous store (on node
0), each rank gets an error file and a collective counter in a private folder, and each
rank's environment names them. Runs in the kernel.
"""

from __future__ import annotations

import os
import shutil
from typing import Any

from .._shared import _collectives
from .._shared._protocol import COLLECTIVES_ENV
from .._shared._starting import scratch_folder
from . import _ports
from ._plan import LaunchPlan


class AttemptSetup:
    """The store, folder and per-rank environments of one attempt; :meth:`close` frees them."""

    def __init__(self, plan: LaunchPlan, number: int, folder_prefix: str) -> None:
        self.store: Any = None
        self.folder: str | None = scratch_folder(folder_prefix)
        try:
            if plan.node_rank == 0:
                self.store = _ports.open_store(plan.master_addr, plan.port, plan.world_size)
            self.port: int = self.store.port if self.store is not None else plan.port or 0
            self.envs = [
                rank_env(plan, local, self.port, number, self.folder)
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


def rank_env(plan: LaunchPlan, local: int, port: int, attempt: int, folder: str) -> dict[str, str]:
    """One rank's environment, with its error file and collective counter in ``folder``."""
    rank = plan.ranks[local]
    os.makedirs(os.path.join(folder, str(rank)), exist_ok=True)
    env = plan.worker_env(local, port, attempt, os.path.join(folder, str(rank), "error.json"))
    env[COLLECTIVES_ENV] = _collectives.create(folder, rank)
    return env
